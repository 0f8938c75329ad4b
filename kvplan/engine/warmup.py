"""Engine warmup: run the kinds of step a server meets before the first request arrives.

Triton compiles a kernel once per specialization of its arguments (the constexpr tiles a launch
plan picks from a size, ints equal to 1, ints and pointers divisible by 16), cuBLAS picks and
loads its kernels per shape, and the caching allocator grows its pools on first use. A step
whose sizes fall in a class the process has not seen pays for that inside the step: on the
H200 the first 8-token prompt after a warm 4 x 2,048 DeepSeek-V4 workload took 11.2-13.0 s
with an empty Triton cache, 26-28 ms every time after; warmed up, 31 ms the first time
(`bench/hybrid_steps.py --warmup off|on`, bench/RESULTS.md session 30).

`warm_up` drives the engine's own step loop (`kvplan.engine.core.EngineCore`) through
throwaway requests with random token ids, so every path is the one real requests take
(scheduler, planning, CUDA-graph replays, eager steps, sampling):

1. one prompt alone for each length of `warmup_prompt_lengths` (1, then ``2^k - 1``,
   ``2^k`` and ``2^k + 1`` up to ``max_model_len``; those above the step's token budget in
   chunks), each with one decode step after;
2. several prompts in one step (as many as ``max_num_seqs`` allows, up to 4), then decode
   steps of that batch;
3. a prompt that joins a request already decoding (a mixed step: prompt and decode rows),
   once with a short and once with a long context behind the decode row;
4. sampled requests (temperature, top-p, top-k; one with its own seed, one drawing from the
   engine's generator) next to a greedy one that asks for output and prompt logprobs;
5. with n-gram speculative decoding on, decode rows carrying drafts to verify (several query
   tokens a row; a row without an n-gram match gets its last token repeated as drafts).

Afterwards nothing of it remains: every request finished (blocks freed, per-request state of
the attention families dropped), the prefix cache is cleared (at construction it held nothing
else; a later `warm_up` call also drops the prefixes cached before it), and the
engine's counters (request ids, steps, graph replays, preemptions, prefix-cache statistics)
and its sampling generator are put back as they were, so the engine serves exactly as one
that never warmed up (same outputs, ids and counters; only which free blocks a request gets
may differ).

`kvplan.LLM` runs it at construction when ``EngineConfig.warmup`` is on (default: on CUDA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvplan.engine.sampling import SamplingParams

# (owner path from the core, attribute) of every counter a warmup must leave as it found it
_COUNTERS = (
    ("", "_next_id"),
    ("", "num_steps"),
    ("", "num_steps_ahead"),
    ("", "num_discarded_rows"),
    ("", "num_fast_decode_steps"),
    ("", "num_graph_argmax_steps"),
    ("", "last_step_kind"),
    ("scheduler", "num_preemptions"),
    ("scheduler", "num_prefix_waits"),
    ("runner.graphs", "num_replays"),
    ("runner.graphs", "num_replays_ahead"),
    ("scheduler.manager.prefix_cache", "num_queried_tokens"),
    ("scheduler.manager.prefix_cache", "num_hit_tokens"),
)


@dataclass(frozen=True)
class WarmupReport:
    """What `warm_up` ran: wall seconds, engine steps and requests, the single-prompt lengths."""

    seconds: float
    num_steps: int
    num_requests: int
    prompt_lengths: tuple[int, ...]


def warmup_prompt_lengths(max_prompt_len: int) -> list[int]:
    """Prompt lengths for phase 1: 1, then ``2^k - 1``, ``2^k`` and ``2^k + 1`` for every
    power of two, and ``max_prompt_len`` itself; none above ``max_prompt_len``. Lengths above
    the step's token budget run in chunks, so later chunks meet every context size class too.

    The launch plans pick tiles from sizes rounded to powers of two, and Triton specializes
    ints on ``== 1`` and ``% 16 == 0``; a length on each side of every power of two reaches
    both sides of each such boundary.

    >>> warmup_prompt_lengths(16)
    [1, 2, 3, 4, 5, 7, 8, 9, 15, 16]
    >>> warmup_prompt_lengths(40)
    [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40]
    """
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    lengths = {1, max_prompt_len}
    p = 2
    while p <= max_prompt_len:
        lengths.update(n for n in (p - 1, p, p + 1) if n <= max_prompt_len)
        p *= 2
    return sorted(lengths)


def _owner(core: Any, path: str) -> Any:
    obj = core
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _snapshot(core: Any) -> list[tuple[Any, str, Any]]:
    saved = []
    for path, attr in _COUNTERS:
        obj = _owner(core, path)
        if obj is not None and hasattr(obj, attr):
            saved.append((obj, attr, getattr(obj, attr)))
    return saved


class _Driver:
    """Adds throwaway requests to ``core`` and steps it until they finish."""

    def __init__(self, core: Any, vocab_size: int, seed: int) -> None:
        self.core = core
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.num_requests = 0
        self.num_steps = 0

    def prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab_size, (n,), generator=self.gen).tolist()

    def add(self, n: int, max_tokens: int, **sampling: Any) -> Any:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        self.num_requests += 1
        return self.core.add_request(self.prompt(n), params)

    def step(self) -> None:
        self.core.step()
        self.num_steps += 1

    def decoding(self) -> bool:
        """Whether every running request has its whole prompt computed (or none runs)."""
        return not any(r.is_prefilling for r in self.core.scheduler.running)

    def run(self) -> None:
        while self.core.has_unfinished():
            self.step()


def warm_up(core: Any, *, vocab_size: int, seed: int = 0) -> WarmupReport:
    """Run the warmup phases (module docstring) through ``core``, then restore its counters,
    its generator and the prefix cache. ``core`` must hold no request. A step that raises
    finishes the running throwaway requests with an error (`EngineCore.step`); the queued ones
    are aborted here, the state restored, and the exception propagates."""
    if core.has_unfinished() or core.requests:
        raise RuntimeError("warm_up needs an idle engine (requests are queued or running)")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    t0 = time.perf_counter()
    saved = _snapshot(core)
    gen_state = core.generator.get_state()
    sched = core.scheduler
    budget = sched.max_num_batched_tokens
    max_len = core.max_model_len
    d = _Driver(core, vocab_size, seed)
    try:
        # 1. each length alone: its prompt step, then one decode step
        longest = max_len - 2 if sched.enable_chunked_prefill else min(max_len - 2, budget)
        lengths = warmup_prompt_lengths(longest) if longest >= 1 else []
        for n in lengths:
            d.add(n, 2)
            d.run()
        # 2. several prompts in one step, then decode steps of that batch
        together = [n for n in (3, 17, 40, 5) if n <= max_len - 4][: min(4, sched.max_num_seqs)]
        while sum(together) > budget:
            together.pop()
        if len(together) >= 2:
            for n in together:
                d.add(n, 4)
            d.run()
        # 3. a prompt joining a request that decodes (a mixed step), its context short or long
        if sched.max_num_seqs >= 2 and max_len > 16:
            for n in sorted({5, max(5, longest - 8)}):
                d.add(n, 8)
                while not d.decoding():
                    d.step()
                d.step()
                d.add(9, 2)
                d.run()
        # 4. sampled requests next to a greedy one asking for logprobs of its output and prompt
        # (the prompt's logits at every position)
        if max_len > 10:
            d.add(6, 3, temperature=0.8, top_p=0.9, top_k=20, seed=seed + 1)
            d.add(7, 3, temperature=1.0)
            d.add(4, 3, logprobs=2, prompt_logprobs=2)
            d.run()
        # 5. with n-gram drafts: decode rows carrying drafts to verify (a row with no n-gram
        # match gets its last token repeated as drafts, so the step kind runs whatever the
        # model samples; rejected drafts are rolled back as usual)
        propose = sched.propose_drafts
        if propose is not None and sched.num_draft_tokens > 0 and max_len > 24:
            k = sched.num_draft_tokens
            sched.propose_drafts = lambda r: propose(r) or [r.last_token_id] * k
            try:
                for n in (5, 12):
                    d.add(n, 6)
                d.run()
            finally:
                sched.propose_drafts = propose
    except BaseException:
        for rid in list(core.requests):  # what the failed step left queued
            core.abort(rid)
        raise
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
        core.generator.set_state(gen_state)
        manager = sched.manager
        if getattr(manager, "prefix_cache", None) is not None:
            manager.reset_prefix_cache()
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)
    return WarmupReport(time.perf_counter() - t0, d.num_steps, d.num_requests, tuple(lengths))
