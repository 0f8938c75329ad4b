"""The hybrid attention family's contract with the model (DeepSeek-V4 style layers).

A hybrid model has three layer kinds (Hugging Face ``layer_types`` names):

* ``"sliding_attention"``            -- raw K=V rows, a query at ``p`` sees raw positions
  ``max(p - W + 1, 0) .. p`` (window ``W``);
* ``"heavily_compressed_attention"`` -- the sliding window plus every compressed entry of
  ratio ``r`` closed by ``p`` (entries ``j < (p + 1) // r``); entry ``j`` pools raw
  positions ``[j*r, (j+1)*r)``;
* ``"compressed_sparse_attention"``  -- the sliding window plus the indexer's top-k of the
  closed compressed entries; entry ``j`` pools the overlapping window ``[(j-1)*r, (j+1)*r)``
  (the first half from the per-token "Ca" series, the second from the "Cb" series).

The model computes everything that has weights (projections, pooling, norms, RoPE, the
indexer's queries and head weights); the family owns every cache and decides what each
query row sees. One ``HybridStepContext`` serves one engine step (every layer, every
sequence of the step). Tokens are flat: rows ``[T]`` of all scheduled sequences back to back
in step order; ``positions[t]`` is the absolute position of row ``t``.

Per layer the model calls, in this order:

1. for a compressed layer, for each compressed series ``name`` (``"compressor"``; CSA layers
   also ``"indexer"``): ``windows = ctx.compress_windows(layer_idx, name, kv, gate)`` with
   the step's per-token projections (``gate`` already includes the position bias of the
   token's offset ``p % r`` inside its window); the model pools each returned window
   (softmax over rows of ``gate``, times ``kv``, summed, then its norm and RoPE at
   ``windows.positions``) and hands the entries back with
   ``ctx.store_entries(layer_idx, name, entries)``;
2. ``out = ctx.attend(layer_idx, q, kv, sinks, scale, index_q=..., index_weights=...)``.

Implementations: ``kvplan.backends.hybrid.reference`` (per-request dense history, the
oracle) and ``kvplan.backends.hybrid.planned`` (planned by ``kvplan.plan`` on kvplan's
paged storage and index ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvplan._checks import check_tensor

LAYER_KINDS = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
SERIES_NAMES = ("compressor", "indexer")


@dataclass(frozen=True)
class HybridLayerSpec:
    """One layer's attention shape, as the family needs it.

    Attributes:
        kind: one of ``LAYER_KINDS``.
        window: sliding window ``W`` (raw keys ``p - W + 1 .. p``).
        ratio: compression ratio ``r`` (0 for sliding layers).
        top_k: entries the indexer keeps per query (CSA only; 0 otherwise).
        head_dim: width ``D`` of a K=V row and of a compressed entry.
        index_head_dim: width of the indexer's compressed keys (CSA only; 0 otherwise).
        num_heads: query heads ``H`` (one shared K=V head).
        num_index_heads: indexer heads (CSA only; 0 otherwise).
    """

    kind: str
    window: int
    ratio: int
    top_k: int
    head_dim: int
    index_head_dim: int
    num_heads: int
    num_index_heads: int

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {LAYER_KINDS}, got {self.kind!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        compressed = self.kind != "sliding_attention"
        if compressed and self.ratio < 1:
            raise ValueError(f"ratio must be >= 1 for a {self.kind} layer, got {self.ratio}")
        if self.kind == "compressed_sparse_attention" and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 for a CSA layer, got {self.top_k}")

    @property
    def overlap(self) -> bool:
        """Whether an entry pools ``2r`` rows (CSA) instead of ``r`` (HCA)."""
        return self.kind == "compressed_sparse_attention"

    def series_width(self, name: str) -> int:
        """Width ``C`` of one pooled entry of series ``name``."""
        return self.index_head_dim if name == "indexer" else self.head_dim


class CompressWindows(NamedTuple):
    """The compression windows that close in this step, for one layer and series.

    ``kv``/``gate``: ``[E, w, C]`` (``w = r``, or ``2r`` for CSA: rows ``0..r-1`` are the
    previous window's "Ca" half ``[..., :C]``, rows ``r..2r-1`` this window's "Cb" half
    ``[..., C:]``; rows before position 0 have ``kv = 0`` and ``gate = -inf``).
    ``positions``: int64 ``[E]``, the RoPE position of each entry (``j * r``).
    ``entry_index``: int64 ``[E]``, ``j`` of each entry within its sequence.
    ``seq_index``: int64 ``[E]``, the step row (sequence) each entry belongs to.
    Entries are ordered by sequence, then by ``j``.
    """

    kv: torch.Tensor
    gate: torch.Tensor
    positions: torch.Tensor
    entry_index: torch.Tensor
    seq_index: torch.Tensor


class HybridStepContext(Protocol):
    """One step of the hybrid family (see the module docstring for the call order)."""

    positions: torch.Tensor  # int64 [T] on the model device

    def compress_windows(
        self, layer_idx: int, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> CompressWindows:
        """``kv``, ``gate``: ``[T, k*C]`` (``k = 2`` for CSA, 1 for HCA) for every row of the
        step; keeps what later steps need (rows of unfinished windows, the last "Ca" half)
        and returns the windows this step closes."""
        ...

    def store_entries(self, layer_idx: int, name: str, entries: torch.Tensor) -> None:
        """Write the pooled entries ``[E, C]`` (in ``compress_windows``' order) into the
        layer's compressed cache of series ``name``."""
        ...

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        *,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Store the step's raw rows ``kv [T, D]`` and attend.

        ``q``: ``[T, H, D]``; ``sinks``: fp32 ``[H]`` (a per-head logit added to the softmax
        denominator only); ``scale``: logit scale. CSA layers pass ``index_q [T, Hi, Ci]``
        and ``index_weights [T, Hi]`` (all scalings folded in): entry ``j``'s score for row
        ``t`` is ``sum_h index_weights[t, h] * relu(index_q[t, h] . key_j)`` and the row sees
        the ``top_k`` best closed entries. ``out_rope``: ``(cos, sin)`` ``[T, RD / 2]``; the
        output rows come back turned by the inverse rotation on their trailing ``RD``
        channels (`unrotate`; the GPU kernels do it in their epilogue). Returns ``[T, H, D]``
        in ``q``'s dtype.
        """
        ...


def unrotate(out: torch.Tensor, out_rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``attend``'s ``out_rope`` for a path whose attention does not apply it:
    ``norm_rope(out, cos, sin, inverse=True)``, or ``out`` itself without tables."""
    if out_rope is None:
        return out
    from kvplan.ops.rope import norm_rope

    return norm_rope(out, *out_rope, inverse=True)


def check_attend_inputs(
    spec: HybridLayerSpec,
    num_rows: int,
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
) -> None:
    """The argument checks every ``HybridStepContext.attend`` starts with: shapes against the
    layer's spec and the step's ``num_rows``; CSA layers need the indexer inputs, other layers
    take none. Raises ``TypeError`` / ``ValueError`` naming the argument."""
    check_tensor("q", q, shape=(num_rows, spec.num_heads, spec.head_dim))
    check_tensor("kv", kv, shape=(num_rows, spec.head_dim))
    check_tensor("sinks", sinks, shape=(spec.num_heads,))
    if spec.kind == "compressed_sparse_attention":
        hi, ci = spec.num_index_heads, spec.index_head_dim
        check_tensor("index_q", index_q, shape=(num_rows, hi, ci))
        check_tensor("index_weights", index_weights, shape=(num_rows, hi))
    elif index_q is not None or index_weights is not None:
        raise ValueError(f"a {spec.kind} layer takes no index_q / index_weights")


@dataclass(frozen=True)
class HybridSeq:
    """One scheduled sequence of a step, as the hybrid family plans it.

    Attributes:
        request_id: the engine's request id (key of the family's per-request state).
        q_start: tokens already in the caches; the step's rows sit at positions
            ``q_start .. q_start + seqlen_q - 1``. ``q_start == 0`` starts the request
            afresh (a new request, or one preempted and recomputed).
        seqlen_q: rows of this sequence in the step.
        token_ids: confirmed token ids, position ``i`` at index ``i`` (at least
            ``q_start + seqlen_q`` entries, or ``q_start + 1`` for a decode row).
        block_table: KV block ids of the compressed pools (one block per ``block_size``
            raw positions; block 0 is the reserved padding block).
        state_id: the request's state slot (SWA ring and compressor state).
    """

    request_id: int
    q_start: int
    seqlen_q: int
    token_ids: tuple[int, ...] | list[int]
    block_table: tuple[int, ...] | list[int]
    state_id: int


class HybridFamily(Protocol):
    """Owns the caches of every hybrid layer across steps; one per engine."""

    def plan(self, seqs: list[HybridSeq], positions: torch.Tensor) -> HybridStepContext:
        """The context of one step over ``seqs`` (their rows back to back; ``positions``
        int64 ``[T]`` on the model device)."""
        ...

    def free(self, request_id: int) -> None:
        """Forget a finished or preempted request's state (its slots return to the pool
        through the cache manager)."""
        ...
