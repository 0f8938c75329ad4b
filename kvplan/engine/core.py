"""Engine core: schedule -> run -> sample -> update, one round trip per step.

After the model runs, the host receives one token per sampling row (one device->host copy)
and updates each request: it commits the K/V it just wrote (``commit_tokens``, which hashes
full blocks for prefix reuse), appends the sampled token(s) and checks the stop rules. A
speculative-verification row accepts the matching drafts (`accept_drafts`) and grows its
logical length over them (``extend``); rejected drafts stay in reserved blocks.

Decode-only steps (every row a plain decode row) take a fast path: one
``commit_tokens_many`` for the whole batch, then per request only the unavoidable Python
(count the computed token, append the sampled one) plus the full stop rules when one of them
could fire. It equals the per-row loop: a commit never reads what an earlier row's finish
(``free``) changed. With ``release_out_of_window`` commits free blocks too, so the order of
frees would differ; that configuration keeps the per-row loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvplan.engine.request import Request
from kvplan.engine.runner import ModelRunner
from kvplan.engine.sampler import sample
from kvplan.engine.sampling import SamplingParams
from kvplan.engine.scheduler import Scheduler
from kvplan.engine.speculative import accept_drafts


class EngineCore:
    """Owns the requests, the scheduler and the runner.

    Args:
        scheduler: a `Scheduler` over the KV cache manager.
        runner: a `ModelRunner`.
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        decode_text: ``f(token_ids) -> str`` for stop strings (None: no detokenizer).
        max_model_len: longest ``prompt + max_tokens`` a request may ask for.
        seed: seed of the generator used by requests without their own seed.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        eos_token_ids: Sequence[int] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.decode_text = decode_text
        self.max_model_len = max_model_len
        self.device = runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.num_steps = 0
        self._pinned: torch.Tensor | None = None  # host buffer of the sampled tokens (CUDA)
        self._copy_in_flight = False
        # decode-only steps take the batched update (False: the per-row loop, for tests)
        self.decode_fast_path = True
        self._copied: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(self._next_id, ids, params, gen)
        self._next_id += 1
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its blocks (no-op when it already finished)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id}")
        if not req.finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got new tokens or finished."""
        sched = self.scheduler.schedule()
        if not sched.seqs:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "no request could be scheduled: the KV pool is too small for the next "
                    "waiting request"
                )
            return []
        logits, inputs = self.runner.execute(sched)
        pending = self._sample(sched, inputs, logits)  # device work queued, copy in flight
        self.num_steps += 1
        manager = self.scheduler.manager
        if self.decode_fast_path and sched.num_contexts == 0 and not manager.release_out_of_window:
            # While the GPU still runs the step: commit the K/V it writes (the step's input
            # tokens, known on the host); only then wait for the sampled tokens.
            manager.commit_tokens_many(inputs.request_ids, inputs.input_ids)
            return self._update_decode_rows(sched, self._wait(pending))
        return self._update_rows(sched, inputs, self._wait(pending))

    def _update_rows(self, sched, inputs, tokens: list[int]) -> list[Request]:
        """Any step, row by row: commit what each row wrote, take its new token(s)."""
        manager = self.scheduler.manager
        touched: list[Request] = []
        for s, sl in zip(sched.seqs, inputs.row_slices):
            req = s.request
            rid = req.request_id
            if not s.is_prefill and not s.drafts:  # plain decode row: the common case
                manager.commit_tokens(rid, [req.last_token_id])
                req.num_computed_tokens += 1
                self._append(req, tokens[sl.start])
                touched.append(req)
                continue
            start = req.num_computed_tokens
            if s.is_prefill:
                manager.commit_tokens(rid, req.all_token_ids[start : start + s.num_query_tokens])
                req.num_computed_tokens += s.num_query_tokens
                new = tokens[sl]
            else:
                new = accept_drafts(s.drafts, tokens[sl])
                accepted = len(new) - 1
                req.num_draft_tokens_proposed += len(s.drafts)
                req.num_draft_tokens_accepted += accepted
                manager.extend(rid, accepted)
                manager.commit_tokens(rid, [req.last_token_id, *s.drafts[:accepted]])
                req.num_computed_tokens += 1 + accepted
            for t in new:
                self._append(req, t)
                if req.finished:
                    break
            if new:
                touched.append(req)
        return touched

    def _update_decode_rows(self, sched, tokens: list[int]) -> list[Request]:
        """Decode-only step, after ``step()`` committed the rows' input tokens: row i sampled
        ``tokens[i]`` (the module docstring says why this equals ``_update_rows``)."""
        batch = sched.decode_batch
        reqs = batch.requests if batch is not None else [s.request for s in sched.seqs]
        eos = self.eos_token_ids
        for req, token in zip(reqs, tokens):
            req.num_computed_tokens += 1
            out = req.output_token_ids
            out.append(token)
            p = req.params
            if (
                len(out) >= p.max_tokens
                or p.stop
                or token in p.stop_token_ids
                or (token in eos and not p.ignore_eos)
            ):
                self._check_stop(req, token)
        return list(reqs)

    def _sample(self, sched, inputs, logits: torch.Tensor) -> torch.Tensor | None:
        """Queue the step's sampling; ``_wait`` of the result gives the tokens on the host,
        one per logits row.

        Greedy fast path: when every scheduled request is greedy, the tokens are the
        device-side ``argmax`` (no per-row parameter lists, no sort). Either way the tokens
        reach the host in one device->host copy (`_to_host`), started here.
        """
        if inputs.logits_rows.shape[0] == 0:
            return None
        seqs = sched.seqs
        batch = sched.decode_batch
        greedy = (
            batch.all_greedy
            if batch is not None
            else all(s.request.params.temperature == 0.0 for s in seqs)
        )
        if greedy:
            return self._to_host(logits.argmax(dim=-1))
        params: list[SamplingParams] = []
        gens: list[torch.Generator | None] = []
        for s, sl in zip(seqs, inputs.row_slices):
            n = sl.stop - sl.start
            params.extend([s.request.params] * n)
            gens.extend([s.request.generator] * n)
        return self._to_host(sample(logits, params, gens, self.generator))

    def _to_host(self, tokens: torch.Tensor) -> torch.Tensor:
        """Start copying ``tokens [N]`` (int64, on the device) to the host; `_wait` returns
        them as Python ints.

        On CUDA the copy goes non-blocking into a preallocated pinned buffer with one event
        recorded after it, and `_wait` waits on that event (not on the whole device).
        """
        if tokens.device.type != "cuda":
            return tokens
        n = tokens.shape[0]
        buf = self._pinned
        if buf is None or buf.shape[0] < n:
            buf = self._pinned = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
        buf[:n].copy_(tokens, non_blocking=True)
        self._copied.record()
        self._copy_in_flight = True
        return buf[:n]

    def _wait(self, pending: torch.Tensor | None) -> list[int]:
        """The sampled tokens started by `_sample` (``[]`` when the step samples none)."""
        if pending is None:
            return []
        if self._copy_in_flight:
            self._copied.synchronize()
            self._copy_in_flight = False
        return pending.tolist()

    def _append(self, req: Request, token: int) -> None:
        req.output_token_ids.append(token)
        self._check_stop(req, token)

    def _check_stop(self, req: Request, token: int) -> None:
        """Finish ``req`` when its newest token ``token`` ends it: a stop token id or EOS
        ("stop"), a stop string in the text ("stop", text cut there), max_tokens ("length")."""
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif p.stop and self.decode_text is not None:  # detokenize only for stop strings
            text = self.decode_text(req.output_token_ids)
            cuts = [text.find(s) for s in p.stop_strings]
            cuts = [c for c in cuts if c >= 0]
            if cuts:
                req.stop_text_len = min(cuts)
                reason = "stop"
        if reason is None and len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
