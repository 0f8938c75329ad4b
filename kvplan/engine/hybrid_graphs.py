"""CUDA graphs for decode-only steps of hybrid (DeepSeek-V4) models, one per batch-size bucket.

A decode step with ``n`` rows replays the graph of the smallest bucket ``b >= n`` (buckets as
`kvplan.engine.cuda_graphs.decode_buckets`). Each bucket owns a
`kvplan.backends.hybrid.static_step.StaticDecodeStep`: every tensor the graph reads (token ids,
positions, the packed decode facts that ``prepare_decode_on_device`` expands, the compressor
window facts) lives in persistent buffers that the step's host half (``stage``) rewrites in
place; the graph holds the device half (decode metadata kernels, ``compute_attn_info``, the
window expansion) and the model's forward. Rows ``n .. b - 1`` are placeholder sequences that
write no cache row; their logits are discarded.

Per step the engine family (`kvplan.engine.hybrid.HybridEngineFamily.plan`) stages the step
when `can_run` holds (the family's continuation checks and bookkeeping as in an eager step),
then the runner calls `run`, which replays.

Async scheduling: a step scheduled ahead (``StepBatch.ahead``) is staged while the step
before may still run on the GPU, with placeholder input tokens (`stage` with ``ahead``);
`run` then copies the previous step's sampled tokens (on the device) over the staged ones
before the replay. Every device buffer is rewritten by copies queued on the stream, so they
land after the replay of the step before; the pinned staging slots alternate
(`kvplan.backends.hybrid.static_step.StaticDecodeBuffers`). ``num_replays_ahead`` counts
the replays of steps scheduled ahead.

Greedy tokens: as `kvplan.engine.cuda_graphs.DecodeGraphs`, the captured forward fills the
static ``tokens`` (the argmax of its logits rows, fused into the LM head; off with
``KVPLAN_GRAPH_ARGMAX=0``), read by `greedy_tokens`. A step scheduled ahead gets the previous
step's tokens (that buffer) as ``device_input_ids``; `run` copies them into the step's input
ids on the stream before the replay that rewrites them.

Capture per bucket (largest first, one memory pool): the step is staged with padding rows
only, one eager run compiles the kernels (the MoE on its sync-free dense path, as under
capture), the step is captured, replayed and compared with the eager logits. Any failure
disables graphs (eager steps keep working) with a note on stderr.

Context tiers: a captured step's widths follow its ``max_seqlen_k`` (every CSA layer scores
and searches ``max_seqlen_k // 4`` candidates a row, every HCA layer lists
``max_seqlen_k // 128`` entries), so a graph captured for ``max_model_len`` makes short
contexts pay for the longest (H100, batch 32 at 4K context: 2.76 ms a step with
``max_model_len`` 4K, 3.22 ms with 128K). Each bucket is also captured for the shorter
``context_tiers`` (default `hybrid_context_bounds`: 8K, then x4 below ``max_model_len``),
and `stage` takes the step of the smallest tier holding the batch's longest row.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

import torch

from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.engine.cuda_graphs import (
    bucket_for,
    capture_checked,
    capture_graph,
    captured,
    context_tiers,
    decode_buckets,
    graph_tokens,
    keep_captured,
    tier_holding,
)
from kvplan.engine.hybrid import HYBRID
from kvplan.engine.step import StepBatch
from kvplan.models.deepseek_v4.moe import graph_safe_routing


class HybridDecodeGraphs:
    """Captured decode steps of a `kvplan.engine.hybrid.HybridCausalLM` (module docstring).

    Args:
        model: the `HybridCausalLM`.
        family: its `kvplan.backends.hybrid.planned.PlannedHybridFamily`.
        max_num_seqs: the largest bucket.
        context_bounds: the shorter context tiers (`context_tiers`); None:
            `hybrid_context_bounds` of the family's ``max_model_len``.

    ``graphs`` / ``logits``: each bucket's graph for ``max_model_len`` and its output;
    ``tier_graphs`` / ``tier_logits``: those of the shorter tiers, by ``(bucket, tier)``;
    ``steps``: the static step of each ``(bucket, tier)``; ``tokens``: the greedy tokens every
    graph writes (`kvplan.engine.cuda_graphs.graph_tokens`; None with
    ``KVPLAN_GRAPH_ARGMAX=0``).
    """

    def __init__(
        self, model: Any, family: Any, max_num_seqs: int, context_bounds: Any = None
    ) -> None:
        self.model = model
        self.family = family
        self.max_model_len = family.config.max_model_len
        if context_bounds is None:
            context_bounds = hybrid_context_bounds(self.max_model_len)
        self.tiers = context_tiers(context_bounds, self.max_model_len)
        self.buckets = decode_buckets(max_num_seqs)
        self.buffers = StaticDecodeBuffers(family, max_num_seqs)
        self.steps = {(b, t): StaticDecodeStep(family, b, self.buffers, t)
                      for b in self.buckets for t in self.tiers}  # fmt: skip
        self.device = family.device
        self.graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> fp32 [b, V]
        self.tier_graphs: dict[tuple[int, int], Any] = {}  # (bucket, tier) -> graph
        self.tier_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.tokens = graph_tokens(max_num_seqs, self.device)  # [max_num_seqs] int64 or None
        self.num_replays = 0
        self.num_replays_ahead = 0  # replays of steps scheduled ahead (device input tokens)
        self.tier_replays = 0  # replays of a shorter tier's graph
        self._ahead: dict[int, bool] = {}  # bucket -> its staged step awaits device tokens
        self._tier: dict[int, int] = {}  # bucket -> the tier of its staged step

    @classmethod
    def maybe_create(
        cls, model: Any, family: Any, max_num_seqs: int, context_bounds: Any = None
    ) -> HybridDecodeGraphs | None:
        """Captured graphs on CUDA; None elsewhere or when capture fails (note on stderr)."""
        if family.device.type != "cuda":
            return None
        if family.trace:
            print("kvplan: CUDA graphs do not trace attention; eager steps", file=sys.stderr)
            return None
        try:
            graphs = cls(model, family, max_num_seqs, context_bounds)
            graphs.capture_all()
        except Exception as exc:  # any capture problem: fall back to eager steps
            print(f"kvplan: CUDA graph capture failed, eager steps ({exc!r})", file=sys.stderr)
            return None
        return graphs

    # ------------------------------------------------------------------ capture
    def staged_step(self, b: int) -> StaticDecodeStep:
        """The static step bucket ``b`` staged last (its tier's)."""
        return self.steps[b, self._tier.get(b, self.max_model_len)]

    def _forward(self, b: int) -> torch.Tensor:
        """The device half of a staged step of bucket ``b`` and the model: fp32 ``[b, V]``."""
        step = self.staged_step(b)
        with torch.inference_mode():
            step.begin()
            tokens = None if self.tokens is None else self.tokens[:b]
            return self.model(step.input_ids, step.positions, {HYBRID: step}, None,
                              argmax_out=tokens)  # fmt: skip

    def _capture(self, b: int, pool: Any) -> Any:
        """Capture the staged step of ``b`` rows; returns the graph (``.replay()``)."""
        graph, self.logits[b] = capture_graph(lambda: self._forward(b), pool)
        return graph

    def capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for b in sorted(self.buckets, reverse=True):
            for tier in self.tiers:  # max_model_len's last: its output stays in logits[b]
                self._tier[b] = tier
                self.steps[b, tier].stage([])  # padding rows only: nothing is written
                what = f"bucket {b}" + (f", tier {tier}" if len(self.tiers) > 1 else "")
                graph = capture_checked(self, b, pool, partial(self._eager, b), what)
                keep_captured(self, b, tier, graph)

    def _eager(self, b: int) -> torch.Tensor:
        with graph_safe_routing(self.model):
            return self._forward(b)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay
    def can_run(self, step: StepBatch) -> bool:
        """Whether ``step`` replays a graph: decode-only (one query token per row; steps
        scheduled ahead included) and a captured bucket holds its rows."""
        n = step.num_seqs
        return (
            step.num_contexts == 0
            and n > 0
            and int(step.num_query_tokens.max()) == 1
            and bucket_for(n, self.buckets) in self.graphs
        )

    def stage(self, seqs: list[Any], ahead: bool = False) -> StaticDecodeStep:
        """Host half of a step over ``seqs`` (decode `HybridSeq` rows, step order): the
        family's checks, the bucket's buffers, the family's bookkeeping; returns the context.
        ``ahead``: a step scheduled ahead, its input tokens placeholders that `run` must
        replace with device tokens."""
        b = bucket_for(len(seqs), self.buckets)
        if b is None or b not in self.graphs:
            raise ValueError(f"no captured bucket holds {len(seqs)} rows")
        self.family.check_continuation(seqs)
        tier = self.tier_for(seqs)
        self.steps[b, tier].stage(seqs)
        self.family.record(seqs)
        self._tier[b] = tier
        self._ahead[b] = bool(ahead)
        return self.steps[b, tier]

    def tier_for(self, seqs: list[Any]) -> int:
        """The smallest tier holding the longest context of ``seqs`` (``q_start + 1``);
        ``max_model_len`` when none does (its step names the row that is too long)."""
        if len(self.tiers) == 1 or not seqs:
            return self.max_model_len
        return tier_holding(self.tiers, max(s.q_start for s in seqs) + 1)

    def run(self, inputs: Any, device_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the staged step of ``n`` rows; logits ``[n, V]`` (a view of the graph's
        output, valid until the next replay of its bucket), their argmax in `greedy_tokens`
        ``(n)`` (valid until the next replay of any bucket).

        ``device_input_ids`` (int64 ``[n]`` on the device): input tokens copied over the staged
        ones on the stream (a step scheduled ahead) before the replay -- so they may be the
        previous replay's ``tokens``, which this replay rewrites.
        """
        n = inputs.input_ids.shape[0]
        b = bucket_for(n, self.buckets)
        tier = self._tier.get(b, self.max_model_len)
        step = self.steps[b, tier]
        if len(step.seqs) != n:
            raise RuntimeError(f"the staged step has {len(step.seqs)} rows, the step {n}")
        if device_input_ids is not None:
            step.input_ids[:n].copy_(device_input_ids)  # queued after the staged upload
            self.num_replays_ahead += 1
        elif self._ahead.get(b):
            raise RuntimeError("a step scheduled ahead needs device_input_ids")
        graph, logits = captured(self, b, tier)
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def greedy_tokens(self, n: int) -> torch.Tensor | None:
        """Int64 ``[n]`` on the device: the argmax of the last replay's first ``n`` logits
        rows (a view of ``tokens``, valid until the next replay); None without ``tokens``."""
        return None if self.tokens is None else self.tokens[:n]


# Context tiers of DeepSeek-V4 decode graphs: from HYBRID_TIER_MIN tokens, x HYBRID_TIER_STEP,
# below max_model_len (more tiers: more captures, each a graph per bucket)
HYBRID_TIER_MIN = 8192
HYBRID_TIER_STEP = 4


def hybrid_context_bounds(max_model_len: int) -> tuple[int, ...]:
    """Default shorter context tiers of `HybridDecodeGraphs` (`context_tiers` adds
    ``max_model_len``): ``HYBRID_TIER_MIN``, then times ``HYBRID_TIER_STEP``, below
    ``max_model_len``; none with ``KVPLAN_HYBRID_GRAPH_TIERS=0`` in the environment (one
    graph a bucket: fewer captures at start, every step at ``max_model_len``'s widths).

    >>> hybrid_context_bounds(131072), hybrid_context_bounds(8192), hybrid_context_bounds(10**6)
    ((8192, 32768), (), (8192, 32768, 131072, 524288))
    """
    if os.environ.get("KVPLAN_HYBRID_GRAPH_TIERS", "1") == "0":
        return ()
    out, tier = [], HYBRID_TIER_MIN
    while tier < max_model_len:
        out.append(tier)
        tier *= HYBRID_TIER_STEP
    return tuple(out)
