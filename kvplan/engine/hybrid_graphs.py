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

Capture per bucket (largest first, one memory pool): the step is staged with padding rows
only, one eager run compiles the kernels (the MoE on its sync-free dense path, as under
capture), the step is captured, replayed and compared with the eager logits. Any failure
disables graphs (eager steps keep working) with a note on stderr.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch

from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.engine.cuda_graphs import bucket_for, capture_checked, capture_graph, decode_buckets
from kvplan.engine.hybrid import HYBRID
from kvplan.engine.step import StepBatch
from kvplan.models.deepseek_v4.moe import graph_safe_routing


class HybridDecodeGraphs:
    """Captured decode steps of a `kvplan.engine.hybrid.HybridCausalLM` (module docstring).

    Args:
        model: the `HybridCausalLM`.
        family: its `kvplan.backends.hybrid.planned.PlannedHybridFamily`.
        max_num_seqs: the largest bucket.
    """

    def __init__(self, model: Any, family: Any, max_num_seqs: int) -> None:
        self.model = model
        self.family = family
        self.buckets = decode_buckets(max_num_seqs)
        self.buffers = StaticDecodeBuffers(family, max_num_seqs)
        self.steps = {b: StaticDecodeStep(family, b, self.buffers) for b in self.buckets}
        self.device = family.device
        self.graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> fp32 [b, V]
        self.num_replays = 0
        self.num_replays_ahead = 0  # replays of steps scheduled ahead (device input tokens)
        self._ahead: dict[int, bool] = {}  # bucket -> its staged step awaits device tokens

    @classmethod
    def maybe_create(cls, model: Any, family: Any, max_num_seqs: int) -> HybridDecodeGraphs | None:
        """Captured graphs on CUDA; None elsewhere or when capture fails (note on stderr)."""
        if family.device.type != "cuda":
            return None
        if family.trace:
            print("kvplan: CUDA graphs do not trace attention; eager steps", file=sys.stderr)
            return None
        try:
            graphs = cls(model, family, max_num_seqs)
            graphs.capture_all()
        except Exception as exc:  # any capture problem: fall back to eager steps
            print(f"kvplan: CUDA graph capture failed, eager steps ({exc!r})", file=sys.stderr)
            return None
        return graphs

    # ------------------------------------------------------------------ capture
    def _forward(self, b: int) -> torch.Tensor:
        """The device half of a staged step of bucket ``b`` and the model: fp32 ``[b, V]``."""
        step = self.steps[b]
        with torch.inference_mode():
            step.begin()
            return self.model(step.input_ids, step.positions, {HYBRID: step}, None)

    def _capture(self, b: int, pool: Any) -> Any:
        """Capture the staged step of ``b`` rows; returns the graph (``.replay()``)."""
        graph, self.logits[b] = capture_graph(lambda: self._forward(b), pool)
        return graph

    def capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for b in sorted(self.buckets, reverse=True):
            self.steps[b].stage([])  # padding rows only: nothing is written
            self.graphs[b] = capture_checked(self, b, pool, partial(self._eager, b), f"bucket {b}")

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
        self.steps[b].stage(seqs)
        self.family.record(seqs)
        self._ahead[b] = bool(ahead)
        return self.steps[b]

    def run(self, inputs: Any, device_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the staged step of ``n`` rows; fp32 logits ``[n, V]`` (a view of the
        graph's output, valid until the next replay of its bucket).

        ``device_input_ids`` (int64 ``[n]`` on the device): input tokens copied over the staged
        ones on the stream (a step scheduled ahead).
        """
        n = inputs.input_ids.shape[0]
        b = bucket_for(n, self.buckets)
        step = self.steps[b]
        if len(step.seqs) != n:
            raise RuntimeError(f"the staged step has {len(step.seqs)} rows, the step {n}")
        if device_input_ids is not None:
            step.input_ids[:n].copy_(device_input_ids)  # queued after the staged upload
            self.num_replays_ahead += 1
        elif self._ahead.get(b):
            raise RuntimeError("a step scheduled ahead needs device_input_ids")
        self.graphs[b].replay()
        self.num_replays += 1
        return self.logits[b][:n]
