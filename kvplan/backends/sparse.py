"""Sparse-attention hooks on the dense metadata contract.

Selection ("which keys") and computation ("attend over them") are two separate concerns joined
only by index arrays. Dense metadata leaves ``sparse_metadata_params`` as ``None`` and its
``sparse_runtime_params`` empty; nothing in the dense path reads them.

``use_sparse_attention`` is the ONE predicate for the dispatch decision "does this layer run
the sparse path": metadata (which builds/validates the selection buffers in ``prepare()``) and
the backend (which routes ``forward`` to the sparse path) both call it, so the two sides can
never disagree about which path a layer takes.

Block-granularity selection, as consumed by the vanilla backend::

    sparse_kv_offsets = [0, 2, 5]          # int32 [num_seqs + 1] (exclusive prefix sums)
    sparse_kv_indices = [0, 3, 0, 1, 4]    # logical block indices of each sequence
    # seq 0 may attend keys in logical blocks {0, 3}; seq 1 in {0, 1, 4}; causality and the
    # sliding window still apply on top of the selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SPARSE_GRANULARITIES = ("block",)


@dataclass(frozen=True)
class SparseMetadataParams:
    """Static sparse settings (allocation-time).

    Args:
        algorithm: free-form name of the selector that fills the runtime indices.
        granularity: unit of selection; only ``"block"`` (KV-cache blocks) is consumed here.
        layers: layer indices that run sparse (``None`` = every layer).
        max_selected_blocks: most blocks one sequence may select (capacity of the buffers).
    """

    algorithm: str = "block_topk"
    granularity: str = "block"
    layers: frozenset[int] | None = None
    max_selected_blocks: int = 64

    def __post_init__(self) -> None:
        if self.granularity not in SPARSE_GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {SPARSE_GRANULARITIES}, got {self.granularity!r}"
            )
        if self.max_selected_blocks <= 0:
            raise ValueError(
                f"max_selected_blocks must be positive, got {self.max_selected_blocks}"
            )
        if self.layers is not None:
            object.__setattr__(self, "layers", frozenset(int(x) for x in self.layers))


@dataclass
class SparseRuntimeParams:
    """Per-step selection produced by a sparse algorithm; all ``None`` for dense attention.

    Fields (host or device int32 tensors):
        sparse_kv_indices: ``[total_selected]`` logical block indices, sequence by sequence.
        sparse_kv_offsets: ``[num_seqs + 1]`` exclusive prefix sums into ``sparse_kv_indices``.
        sparse_attn_indices / sparse_attn_offsets: the query-side selection (which query rows
            take the sparse path) for algorithms that need one; unused by the dense backends.
        sparse_attn_indices_block_size: tokens per selection unit (0 = the cache block size).
    """

    sparse_kv_indices: torch.Tensor | None = None
    sparse_kv_offsets: torch.Tensor | None = None
    sparse_attn_indices: torch.Tensor | None = None
    sparse_attn_offsets: torch.Tensor | None = None
    sparse_attn_indices_block_size: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.sparse_kv_indices is None and self.sparse_attn_indices is None


def use_sparse_attention(params: SparseMetadataParams | None, layer_idx: int | None = None) -> bool:
    """Whether layer ``layer_idx`` takes the sparse path (``None``: whether any layer does).

    Shared by the metadata (builds the selection in ``prepare()`` iff any layer is sparse) and
    the backends (route a layer's ``forward`` to the sparse path iff its layer is sparse).
    """
    if params is None:
        return False
    if layer_idx is None:
        return params.layers is None or bool(params.layers)
    return params.layers is None or layer_idx in params.layers
