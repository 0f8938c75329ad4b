"""Teacher-forced logits through the paged KV cache, and KV-format comparisons.

`prompt_logits` runs a token sequence through the model in chunks of ``chunk_size``: every
chunk attends to the K/V that earlier chunks wrote into the cache (in the engine's KV format,
e.g. FP8), so comparing the logits of two engines that differ only in ``kv_format`` measures
what the cache format costs. `compare_logits` summarizes such a comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplan.engine.core import EngineCore
from kvplan.engine.request import Request
from kvplan.engine.sampling import SamplingParams
from kvplan.engine.step import ScheduledSeq, StepBatch


def prompt_logits(core: EngineCore, token_ids: Sequence[int], chunk_size: int = 16) -> torch.Tensor:
    """Logits of every position of ``token_ids``: fp32 ``[len, vocab]`` on the model device.

    The engine must be idle (no running requests); the sequence gets a fresh request id and
    its blocks are freed at the end.
    """
    core.drain()  # a launched step whose rows all finished already (async scheduling)
    if core.has_unfinished():
        raise ValueError("prompt_logits needs an idle engine (requests are still running)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids = [int(t) for t in token_ids]
    manager = core.scheduler.manager
    runner = core.runner
    dev = runner.device
    req = Request(core.new_request_id(), ids, SamplingParams(max_tokens=1))
    req.num_prefill_tokens = len(ids)
    result = manager.add_request(req.request_id, ids)
    if not result.ok:
        raise ValueError(f"not enough free KV blocks for {len(ids)} tokens")
    try:
        # Reused prefix blocks are recomputed too (every position needs its logits); their
        # K/V is rewritten with the same values, and only the new tokens are committed.
        out = []
        while req.num_computed_tokens < len(ids):
            start = req.num_computed_tokens
            n = min(chunk_size, len(ids) - start)
            step = StepBatch.general([ScheduledSeq(req, n, True)], 1)
            attention = runner.plan(step)
            x = torch.tensor(ids[start : start + n], dtype=torch.int64, device=dev)
            pos = torch.from_numpy(step.positions).to(dev)
            out.append(runner.model(x, pos, attention, None))
            if start + n > result.num_cached_tokens:
                done = max(start, result.num_cached_tokens)
                manager.commit_tokens(req.request_id, ids[done : start + n])
            req.num_computed_tokens += n
    finally:
        manager.free(req.request_id)
        runner.free(req.request_id)
    return torch.cat(out)


@dataclass
class LogitComparison:
    top1_agreement: float  # share of positions whose argmax agrees
    max_abs_error: float
    mean_abs_error: float
    rel_rms_error: float  # ||a - b|| / ||b|| over all logits
    num_positions: int


def compare_logits(test: torch.Tensor, ref: torch.Tensor) -> LogitComparison:
    """Compare ``test [N, V]`` against ``ref [N, V]`` (any float dtype)."""
    if test.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(test.shape)} vs {tuple(ref.shape)}")
    a, b = test.float(), ref.float()
    diff = (a - b).abs()
    return LogitComparison(
        top1_agreement=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        max_abs_error=float(diff.max()),
        mean_abs_error=float(diff.mean()),
        rel_rms_error=float((a - b).norm() / b.norm()),
        num_positions=int(a.shape[0]),
    )
