"""Engine core: schedule -> run -> sample -> update, one round trip per step.

After the model's launches, the host commits the K/V the step writes at tokens it already
knows (``commit_tokens``, which hashes full blocks for prefix reuse: a prompt chunk, a decode
row's input token) while the device still runs; then it receives one token per sampling row
(one device->host copy) and updates each request: appends the sampled token(s) and checks the
stop rules. A speculative-verification row accepts the matching drafts (`accept_drafts`),
grows its logical length over them (``extend``) and commits them after the copy; rejected
drafts stay in reserved blocks.

Decode-only steps (every row a plain decode row) take a fast path: one
``commit_tokens_many`` for the whole batch, then per request only the unavoidable Python
(count the computed token, append the sampled one) plus the full stop rules when one of them
could fire. It equals the per-row loop: a commit never reads what an earlier row's finish
(``free``) changed. With ``release_out_of_window`` (sliding-window layers) a commit also frees
the blocks that left the window; the batched commit leaves those frees to the row loop
(``commit_tokens_many(..., release=False)``, then ``release_dead_blocks`` just before the
row's own update), so blocks reach the free lists in the per-row order and every later block
id is the same as on the per-row path.

Async scheduling (``async_scheduling``): see `kvplan.engine.async_steps`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvplan.engine.async_steps import AsyncSteps, LaunchedStep, unique_requests
from kvplan.engine.host_tokens import Pending, TokenCopies
from kvplan.engine.json_mode import JsonGuide, TokenTrie, start_state, token_bytes
from kvplan.engine.logprobs import PendingLogprobs, TokenLogprob, queue_logprobs
from kvplan.engine.request import Request
from kvplan.engine.runner import ModelRunner, StepInputs
from kvplan.engine.sampling import RowHistory, SamplingParams, prompt_token_mask, sample
from kvplan.engine.scheduler import Scheduler
from kvplan.engine.speculative import accept_drafts
from kvplan.engine.step import StepBatch
from kvplan.ops.argmax import argmax_rows

SCHEMA_VIEWS = 16  # JSON schemas whose token masks are kept (`EngineCore._json_mask`)


class EngineCore(AsyncSteps):
    """Owns the requests, the scheduler and the runner.

    Args:
        scheduler: a `Scheduler` over the KV cache manager.
        runner: a `ModelRunner`.
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        decode_text: ``f(token_ids) -> str`` for stop strings (None: no detokenizer).
        max_model_len: longest ``prompt + max_tokens`` a request may ask for.
        seed: seed of the generator used by requests without their own seed.
        async_scheduling: launch greedy decode steps one step ahead (module docstring);
            None = on for CUDA, off for CPU.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (None: not checked).

    A step that raises (in the scheduler, the model or the sampler) finishes every running
    request with ``finish_reason="error"`` and frees its blocks before the exception
    propagates; waiting requests stay queued and the engine stays usable.

    ``requests`` holds the live (waiting or running) requests only: a request leaves it when
    it finishes. Its results are handed out through the `Request` object that
    ``add_request`` returned (``step()`` also returns the requests it touched, finished ones
    included), so a long-running engine keeps no record of finished requests beyond the
    next request id: ids are sequential, so an id below it that is not live has finished.
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
        async_scheduling: bool | None = None,
        vocab_size: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # JSON mode reads its vocabulary (`_json_mask`)
        self._json_trie: tuple | None = None  # (TokenTrie, token bytes), built on first use
        self._schema_views: dict = {}  # JsonSchema -> its TokenTrie view, most recent last
        self.runner = runner
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.decode_text = decode_text
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.num_steps = 0
        # what the step launched by the last step() call ran: "prefill" (prompt / verification
        # rows only), "mixed" (those and decode rows), "decode", or None (none launched)
        self.last_step_kind: str | None = None
        self._copies = TokenCopies()
        # decode-only steps take the batched update (False: the per-row loop, for tests)
        self.decode_fast_path = True
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda"
        self.async_scheduling = bool(async_scheduling)
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens were read
        self.num_discarded_rows = 0  # rows of those steps whose request had finished
        self.num_fast_decode_steps = 0  # decode-only steps updated by the batched fast path
        # greedy steps whose tokens came from the decode graph's captured argmax
        self.num_graph_argmax_steps = 0
        self._launched: LaunchedStep | None = None
        self._drained: list[Request] = []  # processed by abort/drain, not yet returned

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request; raises ValueError/TypeError (queuing nothing) for a bad prompt
        (empty, a token id that is not an int in ``[0, vocab_size)``, too long) or params."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.check_prompt(prompt_token_ids)
        if params.json_mode:
            self.json_vocab()  # the tokenizer can start an object, or a clear error
        bad = [t for t, _ in params.logit_bias if self.vocab_size and t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(self.new_request_id(), ids, params, gen)
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def _finish_request(self, req: Request, reason: str) -> None:
        """Finish ``req`` (blocks freed) and drop it from ``requests``."""
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """``prompt_token_ids`` as a list of ints, each in ``[0, vocab_size)``, or a
        ValueError/TypeError naming the first bad one."""
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise TypeError(
                f"prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}"
            )
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.vocab_size
        # fast path (C loops): plain ints in range are returned as they are (~0.25 vs 0.65 ms
        # for 8,000 tokens on a 2-core CPU); anything else goes through the loop, which names
        # the first bad one
        plain = set(map(type, ids)) == {int} and min(ids) >= 0
        if plain and (vocab is None or max(ids) < vocab):
            return ids
        out: list[int] = []
        for i, t in enumerate(ids):
            try:
                if isinstance(t, bool):
                    raise TypeError
                v = operator.index(t)  # ints, numpy / 0-d torch integers; not floats
            except TypeError:
                raise TypeError(f"prompt_token_ids[{i}] must be an int, got {t!r}") from None
            if v < 0 or (vocab is not None and v >= vocab):
                raise ValueError(
                    f"prompt_token_ids[{i}]={v} is outside the vocabulary [0, {vocab})"
                )
            out.append(v)
        return out

    def new_request_id(self) -> int:
        """A request id never handed out before by this engine."""
        rid = self._next_id
        self._next_id += 1
        return rid

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its blocks (no-op when it already finished; a
        ValueError for an id this engine never handed out)."""
        is_id = isinstance(request_id, int) and not isinstance(request_id, bool)
        req = self.requests.get(request_id) if is_id else None
        if req is None:
            if is_id and 0 <= request_id < self._next_id:
                return  # finished earlier
            raise ValueError(f"unknown request id {request_id!r}")
        if not req.finished:
            try:
                self.drain()  # the launched step first, as without async scheduling
            except BaseException:
                self._fail_running()
                raise
            if not req.finished:
                self._finish_request(req, "abort")

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: requests waiting or running, or a launched step."""
        return self._launched is not None or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got new tokens or finished (with async
        scheduling: those of the step processed in this call, one step behind). If the step
        raises, its requests are finished with reason ``"error"`` first (class docstring)."""
        try:
            return self._step()
        except BaseException:
            self._fail_running()
            raise

    def _fail_running(self) -> None:
        """Finish every running request with ``"error"`` and drop any launched step."""
        self._launched, self._drained = None, []
        sched = self.scheduler
        for req in list(sched.running):
            self._finish_request(req, "error")  # each leaves the remembered decode batch

    def _step(self) -> list[Request]:
        launched, drained = self._launched, self._drained
        if launched is None and not drained:
            return self._step_now()
        self._launched, self._drained = None, []
        if launched is not None:
            ahead = self._launch_ahead(launched)
            self.last_step_kind = "decode" if ahead is not None else None
            touched = self._finish(launched, ahead)
            if ahead is not None:
                self._launched = ahead
                return unique_requests(drained + touched) if drained else touched
            drained = drained + touched
        return unique_requests(drained + self._step_now())

    def _step_now(self) -> list[Request]:
        """Schedule and launch a step; process it unless async scheduling leaves it launched."""
        step = self.scheduler.schedule()
        ctx = step.num_contexts
        self.last_step_kind = (
            None
            if not step.seqs
            else "decode"
            if not ctx
            else "prefill"
            if ctx == len(step.seqs)
            else "mixed"
        )
        if not step.seqs:
            sched = self.scheduler
            if sched.has_unfinished():
                stuck = sched.waiting[0] if sched.waiting and not sched.running else None
                if stuck is not None:  # nothing will ever free blocks for it
                    self._finish_request(stuck, "error")
                raise RuntimeError(
                    "no request could be scheduled: the KV pool is too small for the next "
                    "waiting request"
                    + ("" if stuck is None else f" (request {stuck.request_id} finished: error)")
                )
            return []
        logits, inputs = self.runner.execute(step)
        tokens, pending = self._sample(step, inputs, logits)  # device work queued, copy started
        logprobs = self._logprobs(step, inputs, logits, tokens)
        self.num_steps += 1
        manager = self.scheduler.manager
        if logprobs is not None:
            return self._update_rows(step, inputs, pending, logprobs)
        if self.decode_fast_path and step.num_contexts == 0:
            batch = step.decode_batch
            if self.async_scheduling and batch is not None and batch.all_greedy:
                self._launched = LaunchedStep(step, inputs, tokens, pending)
                return []
            # While the GPU still runs the step: commit the K/V it writes (the step's input
            # tokens, known on the host); only then wait for the sampled tokens.
            dead = manager.commit_tokens_many(step.request_ids, inputs.input_ids, release=False)
            return self._update_decode_rows(step.requests, self._copies.wait(pending), dead)
        return self._update_rows(step, inputs, pending)

    def _update_rows(
        self,
        step: StepBatch,
        inputs: StepInputs,
        pending: Pending | None,
        logprobs: PendingLogprobs | None = None,
    ) -> list[Request]:
        """Any step, row by row: commit what each row wrote, take its new token(s) (and
        their logprobs, and the prompt logprobs of its chunk, when ``logprobs`` is given).

        The K/V a row wrote at tokens the host knows (a prompt chunk, a decode row's input
        token) is committed first, while the device still runs the step: for a long prompt
        that is hundreds of blocks to hash (~1.3 ms for 8,000 tokens on a 2-core CPU), which
        the device would otherwise wait for before the next step. Their out-of-window frees
        stay in the row loop, so blocks reach the free lists in the order of one pass.
        Verification rows commit what they accept, after the tokens arrive. A wait that
        raises (the device failed the step) forgets every prefix hash.
        """
        manager = self.scheduler.manager
        for s in step.seqs:
            req = s.request
            if s.is_prefill:
                start = req.num_computed_tokens
                ids = req.all_token_ids[start : start + s.num_query_tokens]
                manager.commit_tokens(req.request_id, ids, release=False)
            elif not s.drafts:
                manager.commit_tokens(req.request_id, [req.last_token_id], release=False)
        try:
            tokens = self._copies.wait(pending)
        except BaseException:
            # the device failed the step: blocks hashed above may name K/V it never wrote
            manager.reset_prefix_cache()
            raise
        touched: list[Request] = []
        by_row, prompt = logprobs.resolve() if logprobs is not None else ({}, {})
        verified = {
            i: accept_drafts(s.drafts, tokens[sl])
            for i, (s, sl) in enumerate(zip(step.seqs, inputs.row_slices))
            if s.drafts
        }
        if verified:
            self.runner.drafts_verified(step, {i: len(new) - 1 for i, new in verified.items()})
        for i, (s, sl) in enumerate(zip(step.seqs, inputs.row_slices)):
            req = s.request
            rid = req.request_id
            if not s.is_prefill and not s.drafts:  # plain decode row: the common case
                manager.release_dead_blocks(rid)
                req.num_computed_tokens += 1
                self._append(req, tokens[sl.start], by_row.get(sl.start))
                touched.append(req)
                continue
            if i in prompt:
                req.prompt_logprobs.extend(prompt[i])
            start = req.num_computed_tokens
            if s.is_prefill:
                manager.release_dead_blocks(rid)
                req.num_computed_tokens += s.num_query_tokens
                new = tokens[sl]
            else:
                new = verified[i]
                accepted = len(new) - 1
                req.num_draft_tokens_proposed += len(s.drafts)
                req.num_draft_tokens_accepted += accepted
                manager.extend(rid, accepted)
                manager.commit_tokens(rid, [req.last_token_id, *s.drafts[:accepted]])
                req.num_computed_tokens += 1 + accepted
            for k, t in enumerate(new):
                self._append(req, t, by_row.get(sl.start + k))
                if req.finished:
                    break
            if new:
                touched.append(req)
        return touched

    def _update_decode_rows(
        self, reqs: list[Request], tokens: list[int], dead: np.ndarray
    ) -> list[Request]:
        """Decode-only step, after the rows' input tokens were committed with their
        out-of-window frees left undone: ``reqs[i]`` sampled ``tokens[i]``; rows ``dead``
        (ascending indices) free their dead window blocks first (the module docstring says
        why this equals ``_update_rows``)."""
        eos = self.eos_token_ids
        self.num_fast_decode_steps += 1
        release = set(dead.tolist()) if dead.size else None
        manager = self.scheduler.manager
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if release is not None and i in release:
                manager.release_dead_blocks(req.request_id)
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

    def _sample(
        self, step: StepBatch, inputs: StepInputs, logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, Pending | None]:
        """Queue the step's sampling: (tokens ``[N]`` int64 on the device, their host copy
        started; `TokenCopies.wait` gives them as ints), one per logits row; (None, None)
        when the step samples nothing.

        Greedy fast path: when every scheduled request is greedy, the tokens are the
        device-side ``argmax`` (no per-row parameter lists, no sort): the one a decode graph
        captured (``inputs.greedy_tokens``, one per logits row: no launch after the replay;
        counted in ``num_graph_argmax_steps``), else `argmax_rows` of the logits.
        """
        num_rows = inputs.num_sample_rows
        if num_rows == 0:
            return None, None
        if logits.shape[0] != num_rows:
            logits = logits[:num_rows]  # prompt-logprob rows follow the sampling rows
        seqs = step.seqs
        batch = step.decode_batch
        greedy = (
            batch.all_greedy if batch is not None else all(s.request.params.greedy for s in seqs)
        )
        fused = inputs.greedy_tokens
        if greedy and fused is not None and fused.shape[0] == num_rows:
            # the graph's buffer, which the next replay rewrites: this step's host copy
            # (queued below) lands first
            tokens = fused
            self.num_graph_argmax_steps += 1
        elif greedy:
            tokens = argmax_rows(logits)
        else:
            params: list[SamplingParams] = []
            gens: list[torch.Generator | None] = []
            hist: list[tuple | None] = []
            for s, sl in zip(seqs, inputs.row_slices):
                n = sl.stop - sl.start
                req = s.request
                params.extend([req.params] * n)
                gens.extend([req.generator] * n)
                # one row a request that adjusts its logits (no drafts: it is not greedy)
                hist.extend([self._history(req, logits) if req.params.adjusts_logits else None] * n)
            tokens = sample(logits, params, gens, self.generator, hist)
        return tokens, self._copies.start(tokens)

    def _history(self, req: Request, logits: torch.Tensor) -> RowHistory:
        """The `RowHistory` of a request whose params adjust its logits: the prompt as its
        device token mask (built once) when a repetition penalty reads it; the stop token
        ids and EOS (unless ignored) while ``min_tokens`` holds; JSON mode's allowed set."""
        p = req.params
        banned: tuple[int, ...] = ()
        if len(req.output_token_ids) < p.min_tokens:
            eos = () if p.ignore_eos else sorted(self.eos_token_ids)
            banned = tuple(sorted(set(p.stop_token_ids) | set(eos)))
        allowed = self._json_mask(req, logits.shape[1]) if p.json_mode else None
        prompt = ()
        if p.repetition_penalty != 1.0:
            if req.prompt_token_mask is None:
                req.prompt_token_mask = prompt_token_mask(
                    req.prompt_token_ids, logits.shape[1], logits.device
                )
            prompt = req.prompt_token_mask
        return RowHistory(prompt, req.output_token_ids, banned, allowed)

    def json_vocab(self) -> tuple[TokenTrie, list]:
        """JSON mode's vocabulary trie and token bytes (built on the first call, which takes
        seconds for a large vocabulary); ValueError when the engine has no tokenizer or none
        of its tokens can start a JSON object."""
        if self._json_trie is None:
            if self.tokenizer is None:
                raise ValueError("json_mode needs the engine's tokenizer (this model has none)")
            pieces = token_bytes(self.tokenizer)
            trie = TokenTrie(pieces)
            if not trie.allowed(start_state()).any():
                raise ValueError("json_mode: no token of this tokenizer can start a JSON object")
            self._json_trie = (trie, pieces)
        return self._json_trie

    def _json_mask(self, req: Request, vocab: int) -> np.ndarray:
        """JSON mode: `JsonGuide.mask` of ``req``'s guide (made on first use), fed the output
        so far."""
        if req.json_guide is None:
            trie, pieces = self.json_vocab()
            stops = set(self.eos_token_ids) | set(req.params.stop_token_ids)
            schema = req.params.json_schema
            if schema is not None:  # one trie view (and memo of masks) per schema
                view = self._schema_views.pop(schema, None)
                if view is None:
                    view = trie.view(schema)
                self._schema_views[schema] = view  # the newest last
                while len(self._schema_views) > SCHEMA_VIEWS:
                    del self._schema_views[next(iter(self._schema_views))]
                trie = view
            req.json_guide = JsonGuide(trie, pieces, sorted(stops))
        req.json_guide.feed(req.output_token_ids)
        return req.json_guide.mask(vocab)

    def _logprobs(
        self, step: StepBatch, inputs: StepInputs, logits: torch.Tensor, tokens: torch.Tensor | None
    ) -> PendingLogprobs | None:
        """Queue the logprobs of the step's rows that ask (`queue_logprobs`); None, computing
        nothing, when no row asks."""
        batch = step.decode_batch
        if batch is not None and not batch.any_logprobs:
            return None
        return queue_logprobs(step, inputs, logits, tokens)

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        self._check_stop(req, token)

    def _check_stop(self, req: Request, token: int) -> None:
        """Finish ``req`` when its newest token ``token`` ends it: a stop token id or EOS
        ("stop"), a stop string in the text past its first ``min_tokens`` tokens' ("stop",
        text cut there), max_tokens ("length")."""
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif p.stop and self.decode_text is not None and len(req.output_token_ids) >= p.min_tokens:
            # detokenize only for stop strings; with min_tokens, look past those tokens' text
            text = self.decode_text(req.output_token_ids)
            start = (
                len(self.decode_text(req.output_token_ids[: p.min_tokens])) if p.min_tokens else 0
            )
            cuts = [text.find(s, start) for s in p.stop_strings]
            cuts = [c for c in cuts if c >= 0]
            if cuts:
                req.stop_text_len = min(cuts)
                reason = "stop"
        if reason is None and len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish_request(req, reason)
