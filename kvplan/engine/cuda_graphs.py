"""CUDA graphs for decode-only steps, one per batch-size bucket (block_offsets backend).

A decode step with ``n`` rows replays the graph of the smallest bucket ``b >= n``. The graph
was captured with the engine's own metadata object, so every device tensor it reads is one of
that object's persistent buffers (block-offset table, ``kv_lens``, slot mapping), which
``prepare()`` rewrites in place each step; the model's inputs are static buffers too. Rows
``n .. b-1`` are padding and are made harmless in place before the replay: block 0 (the
always-valid padding block), ``kv_len = 1``, slot ``-1`` (the store skips the row), token 0
at position 0. Only their logits are discarded.

Capture per bucket: ``b`` one-token dummy requests are added to the manager, the metadata is
prepared for them with the host bound ``max_kv_len`` raised to ``max_model_len`` (so the
split-K factor baked into the graph is valid for any length; the kernel cuts each row's own
``kv_len`` into those splits on the device), one eager step compiles the kernels, the step is
captured, replayed and compared with the eager logits, and the dummies are freed. Any failure
disables graphs (eager steps keep working) with a note on stderr.

Context tiers: a launch plan baked in for ``max_model_len`` suits any shorter context, but
where the default decode launch changes with the context (fp8 pages: two KV heads a program
above 4,096 keys, ``kvplan.ops._paged_attention_kernels.DECODE_HEADS_AUTO``) each bucket is
also captured for those bounds (``context_tiers``; the builder asks
``decode_context_bounds``), and a step replays the graph of the smallest tier holding its
longest row, so short contexts keep their own launch under a long ``max_model_len``.

Quantized KV caches (fp8, fp4) are captured like bf16 ones: the kernels read their pages in
place, so a decode step allocates nothing that depends on the step.

Greedy tokens (`graph_argmax_on`, default on): the captured forward also fills the static int64
buffer ``tokens`` with the argmax of its logits rows (``argmax_out``, fused into the LM head:
`kvplan.ops.small_gemm.small_linear`), so a greedy step reads ``greedy_tokens(n)`` instead of
launching `kvplan.ops.argmax.argmax_rows` after the replay. Every bucket's graph writes the same
buffer. Async scheduling passes step r's tokens (that buffer) as the ``device_input_ids`` of
step r + 1, whose `DecodeGraphs.run` copies them into the graph's input buffer on the stream
before the replay that overwrites them, and the engine queues their host copy right after
replay r: both reads land before the next write.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from kvplan.engine.families import PAGED, set_paged_step
from kvplan.engine.step import StepBatch
from kvplan.ops._dispatch import env_flag
from kvplan.ops.argmax import argmax_rows

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Bucket sizes up to ``max_num_seqs`` (always including it).

    >>> decode_buckets(40)
    [1, 2, 4, 8, 16, 24, 32, 40]
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out = [b for b in DEFAULT_BUCKETS if b < max_num_seqs]
    return [*out, max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """Smallest bucket holding ``n`` rows (None when ``n`` is larger than every bucket)."""
    for b in buckets:
        if b >= n:
            return b
    return None


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was after. A collection
    during a CUDA graph capture can free an unreachable graph of another engine, whose reset
    is not permitted while a stream captures: the capture fails and the engine falls back to
    eager steps (seen on an H100 in session 38's GPU suite, where each worker builds engine
    after engine in one process; torch no longer collects before a capture)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def graph_argmax_on() -> bool:
    """Whether decode graphs capture the greedy argmax (module docstring): environment variable
    ``KVPLAN_GRAPH_ARGMAX``, 0 or 1 (default 1; read when a graph set is built). 0 restores the
    argmax after the replay (A/B runs)."""
    return env_flag("KVPLAN_GRAPH_ARGMAX", True)


def graph_tokens(max_num_seqs: int, device: torch.device) -> torch.Tensor | None:
    """The static greedy-token buffer of a graph set: int64 ``[max_num_seqs]`` on ``device``,
    or None when `graph_argmax_on` is off."""
    if not graph_argmax_on():
        return None
    return torch.zeros(max_num_seqs, dtype=torch.int64, device=device)


def capture_graph(forward: Any, pool: Any) -> tuple[Any, Any]:
    """Capture ``forward()`` into a CUDA graph sharing the memory ``pool``, with the garbage
    collector paused (`gc_paused`): returns (the graph, its output tensor, rewritten by every
    ``graph.replay()``)."""
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def context_tiers(bounds: Any, max_model_len: int) -> list[int]:
    """The host bounds on a step's longest row that decode graphs are captured for:
    ``bounds`` below ``max_model_len``, ascending, then ``max_model_len``.

    >>> context_tiers((4096,), 32768), context_tiers((4096,), 2048), context_tiers((), 64)
    ([4096, 32768], [2048], [64])
    """
    return [*sorted({int(t) for t in bounds if 0 < t < max_model_len}), max_model_len]


def tier_holding(tiers: list[int], longest: int) -> int:
    """The smallest of ``tiers`` (ascending, `context_tiers`) holding a step whose longest
    row has ``longest`` keys; the last (``max_model_len``) when none does.

    >>> tier_holding([4096, 32768], 4096), tier_holding([4096, 32768], 4097)
    (4096, 32768)
    """
    for tier in tiers:
        if longest <= tier:
            return tier
    return tiers[-1]


def keep_captured(graphs: Any, b: int, tier: int, graph: Any) -> None:
    """File bucket ``b``'s graph captured for ``tier`` in ``graphs`` (a `DecodeGraphs` or a
    hybrid one): ``max_model_len``'s in ``graphs.graphs`` (its output stays in ``logits[b]``:
    capture it last), a shorter tier's in ``tier_graphs`` with its output in
    ``tier_logits``."""
    if tier == graphs.max_model_len:
        graphs.graphs[b] = graph
    else:
        graphs.tier_graphs[b, tier] = graph
        graphs.tier_logits[b, tier] = graphs.logits[b]


def captured(graphs: Any, b: int, tier: int) -> tuple[Any, torch.Tensor]:
    """(graph, output) of bucket ``b`` for ``tier`` (`keep_captured`); counts a shorter
    tier's replay in ``graphs.tier_replays``."""
    if tier == graphs.max_model_len:
        return graphs.graphs[b], graphs.logits[b]
    graphs.tier_replays += 1
    return graphs.tier_graphs[b, tier], graphs.tier_logits[b, tier]


def kv_format_context_bounds(kv_format: str) -> tuple[int, ...]:
    """`context_tiers`' bounds for a dense cache of ``kv_format``: where its default decode
    launch changes with the context (``decode_context_bounds`` of every launch key the
    format's pages can take, ``decode_keys``).

    >>> kv_format_context_bounds("bf16")
    ()
    """
    from kvplan.cache.kv_tensors import QUANTIZED_KV_FORMATS
    from kvplan.ops._paged_attention_kernels import decode_context_bounds, decode_keys

    dtype = QUANTIZED_KV_FORMATS.get(kv_format, (None,))[0]
    return tuple(sorted({b for k in decode_keys(dtype) for b in decode_context_bounds(k)}))


def capture_checked(graphs: Any, b: int, pool: Any, eager: Any, what: str) -> Any:
    """Capture bucket ``b`` of ``graphs`` (a `DecodeGraphs` or a hybrid one: its ``_capture``,
    ``_sync``, ``logits`` and ``tokens``) after one eager step, ``eager()``, which compiles the
    kernels outside the capture; the graph's replay must give that step's logits (``what``
    names the graph in the error). With ``tokens`` (`graph_argmax_on`), the eager step's and
    the replay's greedy tokens must each equal `argmax_rows` of their logits."""
    want = eager().clone()
    tokens = graphs.tokens
    if tokens is not None and not torch.equal(tokens[:b], argmax_rows(want)):
        raise RuntimeError(f"the eager step's fused argmax differs from argmax_rows ({what})")
    graphs._sync()
    graph = graphs._capture(b, pool)
    graph.replay()
    graphs._sync()
    if not torch.allclose(graphs.logits[b], want, atol=1e-2, rtol=1e-2):
        raise RuntimeError(f"graph replay differs from the eager step ({what})")
    if tokens is not None and not torch.equal(tokens[:b], argmax_rows(graphs.logits[b])):
        raise RuntimeError(f"the replayed argmax differs from argmax_rows of its logits ({what})")
    return graph


class _HostStamp:
    """`torch.cuda.Event`'s ``record`` / ``elapsed_time`` on the host clock (CPU runs)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostStamp) -> float:
        return (end.t - self.t) * 1e3


def _stamp(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return _HostStamp()


class DecodeGraphs:
    """Captured decode steps of a model whose layers are all served by the paged family,
    on block_offsets metadata (see the module docstring). ``graphs`` / ``logits``: the
    bucket's graph for ``max_model_len`` and its output; ``tier_graphs`` / ``tier_logits``:
    those of the shorter ``context_tiers``, by ``(bucket, tier)``; ``tokens``: the greedy
    tokens every graph writes (`graph_tokens`; None with ``KVPLAN_GRAPH_ARGMAX=0``)."""

    def __init__(
        self, model: Any, metadata: Any, manager: Any, max_num_seqs: int, max_model_len: int,
        context_bounds: Any = (), recent: Any = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.metadata = metadata
        # kv_exact_window's `kvplan.cache.recent_window.RecentWindow` (persistent buffers the
        # graphs read; the capture dummies get ring slots) or None
        self.recent = recent
        self.attention = {PAGED: metadata}  # what the model reads: the paged family's plan
        self.manager = manager
        self.max_model_len = max_model_len
        self.tiers = context_tiers(context_bounds, max_model_len)
        self.device = metadata.device
        self.buckets = decode_buckets(max_num_seqs)
        # static inputs: row 0 token ids, row 1 positions, so that one host->device copy per
        # step writes both (from a pinned staging buffer on CUDA). Two staging slots, used in
        # turn: run() r rewrites the slot of run() r - 2, and the engine launches run r only
        # after waiting for the sampled tokens of run r - 2 or later (with async scheduling
        # run r - 1 may still be pending), which were queued after that slot's copy.
        self._inputs = torch.zeros(2, max_num_seqs, dtype=torch.int64, device=self.device)
        self._staging = torch.zeros(
            2, 2, max_num_seqs, dtype=torch.int64, pin_memory=self.device.type == "cuda"
        )
        self._slot = 0
        self.input_ids = self._inputs[0]  # [max_num_seqs] int64
        self.positions = self._inputs[1]  # [max_num_seqs] int64
        self.graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self.logits: dict[int, torch.Tensor] = {}
        self.tier_graphs: dict[tuple[int, int], Any] = {}  # (bucket, tier) -> graph
        self.tier_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.tokens = graph_tokens(max_num_seqs, self.device)  # [max_num_seqs] int64 or None
        self.num_replays = 0
        self.tier_replays = 0  # replays of a shorter tier's graph
        # None, or a list that `run` extends by (rows, bucket, start, end) per replay: device
        # events around it (`replay_device_ms`; benchmarks)
        self.replay_events: list[tuple[int, int, Any, Any]] | None = None

    @classmethod
    def maybe_create(
        cls, model: Any, backend_cls: Any, metadata: Any, manager: Any, max_num_seqs: int,
        max_model_len: int, context_bounds: Any = (), recent: Any = None,
    ) -> DecodeGraphs | None:  # fmt: skip
        if metadata.device.type != "cuda":
            return None
        if set(model.layer_families) != {PAGED}:
            print("kvplan: CUDA graphs need every layer on the paged family; eager steps",
                  file=sys.stderr)  # fmt: skip
            return None
        if getattr(backend_cls, "name", "") != "block_offsets":
            print(
                "kvplan: CUDA graphs need the block_offsets backend; eager steps", file=sys.stderr
            )
            return None
        graphs = cls(model, metadata, manager, max_num_seqs, max_model_len, context_bounds,
                     recent)  # fmt: skip
        try:
            graphs.capture_all()
        except Exception as exc:  # any capture problem: fall back to eager steps
            print(f"kvplan: CUDA graph capture failed, eager steps ({exc!r})", file=sys.stderr)
            return None
        return graphs

    # ------------------------------------------------------------------ capture
    def _prepare_dummies(self, b: int, tier: int) -> list[Any]:
        """``b`` one-token dummy requests planned for ``tier``; on any failure the ones
        already added are freed again (a failed capture leaks no block and no ring slot)."""
        md = self.metadata
        ids = [("kvplan-graph-dummy", i) for i in range(b)]
        added = []
        try:
            for rid in ids:
                if not self.manager.add_request(rid, [0]).ok:
                    raise RuntimeError(f"no free blocks for {b} capture dummies")
                added.append(rid)
            set_paged_step(md, ids, [1] * b, np.zeros(b, np.int32), np.ones(b, np.int32), 0)
            if self.recent is not None:
                md.recent = self.recent.plan(ids, np.zeros(b, np.int32), np.ones(b, np.int32))
        except BaseException:
            self._free_dummies(added)
            raise
        # host bound only: the graph's launch plan (split-K factor, heads a program) must
        # suit any kv_len up to the tier
        md.kv_lens_np = np.full(b, tier, np.int32)
        return ids

    def _free_dummies(self, ids: list[Any]) -> None:
        for rid in ids:
            self.manager.free(rid)
            if self.recent is not None:
                self.recent.free(rid)

    def _forward(self, b: int) -> torch.Tensor:
        tokens = None if self.tokens is None else self.tokens[:b]
        return self.model(self.input_ids[:b], self.positions[:b], self.attention, None,
                          argmax_out=tokens)  # fmt: skip

    def _capture(self, b: int, pool: Any) -> Any:
        """Capture one decode step of ``b`` rows; returns the graph (``.replay()``) and sets
        ``self.logits[b]`` to its output."""
        graph, self.logits[b] = capture_graph(lambda: self._forward(b), pool)
        return graph

    def capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for b in sorted(self.buckets, reverse=True):
            for tier in self.tiers:  # max_model_len's last: its output stays in logits[b]
                keep_captured(self, b, tier, self._capture_checked(b, tier, pool))

    def _capture_checked(self, b: int, tier: int, pool: Any) -> Any:
        """Capture bucket ``b`` for contexts up to ``tier``; its replay must give the eager
        step's logits."""
        ids = self._prepare_dummies(b, tier)
        try:
            self.input_ids[:b] = torch.arange(b, device=self.device) % 7
            self.positions[:b] = 0
            what = f"bucket {b}, tier {tier}"
            return capture_checked(self, b, pool, partial(self._forward, b), what)
        finally:
            self._free_dummies(ids)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay
    def can_run(self, step: StepBatch) -> bool:
        """Whether ``step`` (its paged metadata prepared) can replay a graph: decode-only
        (one query token per row) and a captured bucket holds its rows."""
        n = step.num_seqs
        return (
            step.num_contexts == 0
            and n > 0
            and int(step.num_query_tokens.max()) == 1
            and bucket_for(n, self.buckets) in self.graphs
        )

    def run(self, inputs: Any, device_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for ``n`` decode rows (metadata already prepared); logits ``[n, V]`` (a view
        of the graph's output, valid until the next replay), their argmax in
        `greedy_tokens` ``(n)``.

        ``device_input_ids`` (int64 ``[n]`` on the device): the rows' input tokens, copied
        over the staged host ``input_ids`` on the stream (a step scheduled ahead) before the
        replay -- so they may be the previous replay's ``tokens``, which this replay rewrites.
        """
        n = inputs.input_ids.shape[0]
        b = bucket_for(n, self.buckets)
        md = self.metadata
        if b > n:
            md.kv_cache_block_offsets[:, n:b].zero_()
            md.arena.view("kv_lens")[n:b].fill_(1)
            for p in range(md.kv_cache_block_offsets.shape[0]):
                md.arena.view(f"slots{p}")[n:b].fill_(-1)
            if self.recent is not None:
                self.recent.pad(n, b)
        staging = self._staging[self._slot]
        self._slot ^= 1
        host = staging.numpy()  # [2, max_num_seqs]: padding rows are token 0 at pos 0
        host[0, :n] = inputs.input_ids
        host[1, :n] = inputs.positions
        host[:, n:b] = 0
        self._inputs[:, :b].copy_(staging[:, :b], non_blocking=True)
        if device_input_ids is not None:
            self.input_ids[:n].copy_(device_input_ids)
        graph, logits = captured(self, b, self._tier(md, n))
        self.num_replays += 1
        if self.replay_events is None:
            graph.replay()
        else:
            start, end = _stamp(self.device), _stamp(self.device)
            start.record()
            graph.replay()
            end.record()
            self.replay_events.append((n, b, start, end))
        return logits[:n]

    def greedy_tokens(self, n: int) -> torch.Tensor | None:
        """Int64 ``[n]`` on the device: the argmax of the last replay's first ``n`` logits
        rows (a view of ``tokens``, valid until the next replay); None without ``tokens``."""
        return None if self.tokens is None else self.tokens[:n]

    def replay_device_ms(self, rows: int) -> list[float]:
        """Device milliseconds of each replay that ``replay_events`` recorded for ``rows``
        rows (waits for the device): the graph's own time in the steps that ran it, whatever
        the host did around them."""
        self._sync()
        return [s.elapsed_time(e) for n, _, s, e in self.replay_events or () if n == rows]

    def _tier(self, md: Any, n: int) -> int:
        """The smallest tier holding the step's longest row (of ``md``'s ``n`` rows); without
        shorter tiers no row is looked at."""
        if len(self.tiers) == 1:
            return self.max_model_len
        return tier_holding(self.tiers, int(md.kv_lens_np[:n].max()))
