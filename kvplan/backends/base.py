"""``AttentionBackend``: the per-layer object a model calls; ``forward`` = store, then attend.

Semantics shared by all backends (what every output must equal; the tests' dense reference):

* self attention: the queries of sequence b are its last ``seq_lens[b]`` positions
  ``p = kv_lens[b] - seq_lens[b] + i``; query p sees keys ``max(0, p - W + 1) .. p`` (W = the
  sliding window; unbounded when ``None``). ``kv_lens = num_cached_tokens_per_seq +
  seq_lens_kv`` already counts this step's tokens, which ``forward`` stores before attending.
* cross attention (``metadata.is_cross``): every query of sequence b sees all ``kv_lens[b]``
  encoder keys (no causal mask, no window); new encoder K/V (``seq_lens_kv[b]`` rows, context
  rows only) are stored first.
* the window of a layer is the backend's ``sliding_window`` when given, else
  ``metadata.layer_windows[layer_idx]`` when the metadata has per-layer windows.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from kvplan._checks import check_tensor
from kvplan.backends.block_tables import pool_of_layer
from kvplan.backends.metadata import AttentionMetadata
from kvplan.backends.sparse import use_sparse_attention


class AttentionBackend:
    """One attention layer's view of the backend.

    Args:
        layer_idx: which layer's K/V cache this object stores into and reads.
        num_heads, num_kv_heads: query and KV heads (``num_heads % num_kv_heads == 0``, GQA).
        head_dim: D.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        sliding_window: keys older than this many positions are invisible (``None`` = full).

    ``forward(q [T, H, D], k [T_kv, Hkv, D], v [T_kv, Hkv, D], metadata) -> [T, H, D]`` with
    ``T = metadata.num_tokens`` and ``T_kv = metadata.num_kv_tokens`` (tokens in batch order);
    k and v may be ``None`` when the step writes no K/V (cross attention on generation rows).
    """

    name: ClassVar[str] = "base"
    Metadata: ClassVar[type[AttentionMetadata]] = AttentionMetadata
    # whether _attend implements the sparse path chosen by use_sparse_attention
    supports_sparse: ClassVar[bool] = False

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        for fname, val in (
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{fname} must be a positive int, got {val!r}")
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.sliding_window = sliding_window

    # ------------------------------------------------------------------ helpers
    def window(self, metadata: AttentionMetadata) -> int | None:
        """Effective sliding window of this layer (``None`` for cross attention)."""
        if metadata.is_cross:
            return None
        if self.sliding_window is not None:
            return self.sliding_window
        windows = metadata.layer_windows
        if windows is not None and self.layer_idx < len(windows):
            return windows[self.layer_idx]
        return None

    def pool(self, metadata: AttentionMetadata) -> int:
        return pool_of_layer(metadata.kv_cache_manager, self.layer_idx)

    def store_target(self, metadata: AttentionMetadata, num_tokens: int) -> tuple | None:
        """Where this step's K/V rows (``num_tokens``, one per query token) go, for a caller
        that writes them itself (``kvplan.models.fused.qkv_epilogue``'s ``kv_store``) and
        then passes ``kv_stored=True`` to `forward`: ``(k_cache, v_cache, slots)`` for a plain
        bf16 cache, ``(raw_k, raw_v, slots, layout)`` for a quantized one (uint8 token
        records); None where `forward` must store (no cache, fp16 / fp32 caches, rows that
        are not the step's tokens)."""
        cache = metadata.kv_cache
        fmt = getattr(cache, "kv_format", None)
        if (
            metadata.kv_cache_manager is None
            or cache is None
            or not (fmt == "bf16" or getattr(cache, "is_quantized", False))
            or metadata.num_kv_tokens != num_tokens
            or num_tokens == 0
        ):
            return None
        slots = metadata.slot_mapping(self.pool(metadata))
        if fmt == "bf16":
            return cache.k_cache(self.layer_idx), cache.v_cache(self.layer_idx), slots
        raw = cache.raw_k_cache(self.layer_idx), cache.raw_v_cache(self.layer_idx)
        return (*raw, slots, cache.layout)

    def uses_sparse(self, metadata: AttentionMetadata) -> bool:
        return use_sparse_attention(metadata.sparse_metadata_params, self.layer_idx)

    def _check_inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> None:
        if not isinstance(metadata, self.Metadata):
            raise TypeError(
                f"metadata must be a {self.Metadata.__name__} for the {self.name!r} backend, "
                f"got {type(metadata).__name__}"
            )
        if not getattr(metadata, "prepared", False):
            raise ValueError("metadata.prepare() must run after the last per-step field change")
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        check_tensor("q", q, shape=(metadata.num_tokens, h, d))
        if metadata.num_kv_tokens == 0 and k is None and v is None:
            return
        check_tensor("k", k, shape=(metadata.num_kv_tokens, hkv, d), device=q.device)
        check_tensor("v", v, shape=(metadata.num_kv_tokens, hkv, d), device=q.device)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: AttentionMetadata,
        *,
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store this step's K/V into ``metadata.kv_cache`` (layer ``layer_idx``), then attend.

        ``kv_stored``: the caller already wrote ``k`` / ``v`` at the slots of `store_target`
        (e.g. ``qkv_epilogue``'s fused store); the store is skipped."""
        self._check_inputs(q, k, v, metadata)
        if self.uses_sparse(metadata) and not self.supports_sparse:
            raise NotImplementedError(
                f"layer {self.layer_idx} is sparse (use_sparse_attention) but the {self.name!r} "
                "backend has no sparse path; use 'vanilla' for sparse layers"
            )
        pool = self.pool(metadata)
        if (
            not kv_stored
            and metadata.kv_cache_manager is not None
            and metadata.kv_cache is not None
            and k is not None
            and metadata.num_kv_tokens > 0
        ):
            # Slots were validated on the host by prepare(); skip the store's device-side check.
            metadata.kv_cache.store(self.layer_idx, k, v, metadata.slot_mapping(pool), check=False)
        recent = metadata.recent
        if recent is not None and k is not None and metadata.num_kv_tokens > 0:
            recent.store(self.layer_idx, k, v)  # the unquantized copy (also when kv_stored)
        if out is None:
            out = torch.empty_like(q)
        else:
            check_tensor("out", out, shape=tuple(q.shape), dtype=q.dtype, device=q.device)
        if metadata.num_tokens == 0:
            return out
        return self._attend(q, k, v, metadata, pool, out)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: AttentionMetadata,
        pool: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError
