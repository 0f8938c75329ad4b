"""Attention backends: the metadata contract and three kernel formats.

``get_backend(name)`` returns the backend class; ``backend.Metadata`` is its metadata class:

* ``"vanilla"``       -- gather paged K/V into contiguous NHD, torch SDPA (the anchor);
* ``"ragged"``        -- FlashInfer-style ragged page table (indices / indptr / last_page_len);
* ``"block_offsets"`` -- TensorRT-LLM-style block-offset table
  ``[num_pools, max_batch, 2, max_blocks_per_seq]``.

One step, top-down (host, then device)::

    metadata.py              AttentionMetadata: set_step() / setters -> prepare():
                             _prepare_common (checks, cu_seqlens, kv_lens), then
    ragged.py (or vanilla.py, block_offsets.py)
                             _prepare_backend: the backend's kernel format
      paged_metadata.py        _step_rows: the batch's block-table rows, checked
        block_tables.py          (numpy table math: slots, page lists, checks)
      staging/                 arena.begin / put / commit: ONE async H2D copy
                               (arena.py, pinned_ring.py); expand.py: one kernel for
                               the per-token slots and the ragged page list
    base.py                  AttentionBackend.forward: store K/V, then _attend
    page_table_attention.py  PageTableAttention._attend: md.paged_view(pool) ->
                             attend_paged -> kvplan.ops.paged_attention (Triton)

``lengths.py`` validates length vectors (int32, prefix sums); ``sparse.py`` holds the sparse
hooks; ``page_table_check.py`` a ragged self-check; ``hybrid/`` the hybrid family's contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvplan.backends.base import AttentionBackend
from kvplan.backends.metadata import AttentionMetadata
from kvplan.backends.sparse import (
    SparseMetadataParams,
    SparseRuntimeParams,
    use_sparse_attention,
)

# name -> (module, backend class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "vanilla": ("kvplan.backends.vanilla", "VanillaAttention"),
    "ragged": ("kvplan.backends.ragged", "RaggedAttention"),
    "block_offsets": ("kvplan.backends.block_offsets", "BlockOffsetsAttention"),
}
BACKEND_NAMES = tuple(_BACKENDS)

_LAZY: dict[str, str] = {
    "VanillaAttention": "kvplan.backends.vanilla",
    "VanillaAttentionMetadata": "kvplan.backends.vanilla",
    "RaggedAttention": "kvplan.backends.ragged",
    "RaggedAttentionMetadata": "kvplan.backends.ragged",
    "BlockOffsetsAttention": "kvplan.backends.block_offsets",
    "BlockOffsetsAttentionMetadata": "kvplan.backends.block_offsets",
}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class called ``name`` (one of ``BACKEND_NAMES``)."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "BlockOffsetsAttention",
    "BlockOffsetsAttentionMetadata",
    "RaggedAttention",
    "RaggedAttentionMetadata",
    "SparseMetadataParams",
    "SparseRuntimeParams",
    "VanillaAttention",
    "VanillaAttentionMetadata",
    "get_backend",
    "use_sparse_attention",
]

if TYPE_CHECKING:  # pragma: no cover
    from kvplan.backends.block_offsets import BlockOffsetsAttention, BlockOffsetsAttentionMetadata
    from kvplan.backends.ragged import RaggedAttention, RaggedAttentionMetadata
    from kvplan.backends.vanilla import VanillaAttention, VanillaAttentionMetadata
