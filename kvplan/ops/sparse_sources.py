"""Key sources of ``kvplan.ops.sparse_attention`` and ``kvplan.ops.index_scores``: a cache read
in place through an int32 slot table, how the Triton kernels address it, and the torch gather.

A source is one of::

    plain rows      fp32 / bf16 [N, D]                      slot s = row s
    plain paged     fp32 / bf16 [num_blocks, block_size, 1, D]
    quantized paged uint8 [num_blocks, block_size, 1, bytes_per_token] + layout
                    (token-interleaved record: e4m3 or e2m1 values, UE8M0 or e4m3 scales;
                    the index scorer also takes split index layouts, fp32 scales included)
    paged slot s = block s // block_size, row s % block_size
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvplan import quant
from kvplan._checks import check_tensor
from kvplan.formats import KVCacheFormat, resolve_kv_cache_layout, split_kv_cache
from kvplan.ops import _sparse_attention_kernels as _k

MAX_HEAD_DIM = 512


class KeySource(NamedTuple):
    """One key source: ``cache`` (see the module docstring), ``index`` int32 ``[T, K]`` slots
    (``-1`` = not visible), ``layout`` (quantized paged caches only)."""

    cache: torch.Tensor
    index: torch.Tensor
    layout: KVCacheFormat | None = None


class SourceAddress(NamedTuple):
    """How the kernel addresses one source (strides in elements of ``ptr``'s dtype)."""

    ptr: torch.Tensor
    kind: int
    sf: int
    group: int
    num_slots: int
    block_size: int
    stride_block: int
    stride_token: int
    scale_stride: int
    scale_offset: int


_SF = {"ue8m0": _k.SF_UE8M0, "e4m3": _k.SF_E4M3, "fp32": _k.SF_FP32}


def source_address(
    i: int, src: KeySource, head_dim: int, *, split_ok: bool = False
) -> SourceAddress:
    """Kernel addressing of ``src`` (named ``sources[i]`` in errors) for ``head_dim``-wide
    rows; ``split_ok`` admits split (index) layouts and fp32 scales."""
    name = f"sources[{i}].cache"
    cache, layout = src.cache, src.layout
    if layout is not None and layout.is_quantized:
        layout = resolve_kv_cache_layout(check_tensor(name, cache, dtype=torch.uint8), layout)
        if not (split_ok or (layout.do_cast and layout.token_interleaved)):
            raise ValueError(
                f"{name}: layout {layout.note!r} must be a token-interleaved cast layout"
            )
        if layout.quantized_dtype == "int8":
            raise ValueError(f"{name}: int8 values are not supported")
        if layout.sf_format not in _SF or (layout.sf_format == "fp32" and not split_ok):
            raise ValueError(f"{name}: scale format {layout.sf_format!r} is not supported")
        if layout.elements != head_dim:
            raise ValueError(f"{name}: layout has {layout.elements} elements, q has D = {head_dim}")
        kind = _k.KIND_E4M3 if layout.quantized_dtype == "e4m3" else _k.KIND_E2M1
        nb, bs = cache.shape[0], cache.shape[1]
        vb, bpt = layout.value_bytes, layout.bytes_per_token
        if layout.token_interleaved:
            stride_token, scale_stride, scale_offset = bpt, bpt, vb
        else:
            stride_token, scale_stride, scale_offset = vb, layout.sf_bytes, bs * vb
        return SourceAddress(cache, kind, _SF[layout.sf_format], layout.elements_per_sf, nb * bs, bs,
                     cache.stride(0), stride_token, scale_stride, scale_offset)  # fmt: skip
    if layout is not None and layout.elements != head_dim:
        raise ValueError(f"{name}: layout has {layout.elements} elements, q has D = {head_dim}")
    check_tensor(name, cache, dtype=(torch.float32, torch.bfloat16))
    kind = _k.KIND_FP32 if cache.dtype == torch.float32 else _k.KIND_BF16
    if cache.dim() == 2:
        check_tensor(name, cache, shape=(None, head_dim))
        if head_dim > 1 and cache.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride on D, got strides {cache.stride()}")
        return SourceAddress(cache, kind, 0, 1, cache.shape[0], 1, cache.stride(0), 0, 0, 0)
    check_tensor(name, cache, shape=(None, None, 1, head_dim))
    if head_dim > 1 and cache.stride(3) != 1:
        raise ValueError(f"{name} must have unit stride on D, got strides {cache.stride()}")
    nb, bs = cache.shape[0], cache.shape[1]
    return SourceAddress(cache, kind, 0, 1, nb * bs, bs, cache.stride(0), cache.stride(1), 0, 0)


def flat_scales(a: SourceAddress, head_dim: int, d_p2: int) -> bool:
    """Whether whole, power-of-two scale groups tile a quantized row (the kernels then load
    its scales as ``[TILE_N, G]``)."""
    if a.kind < _k.KIND_E4M3 or head_dim != d_p2 or head_dim % a.group:
        return False
    groups = head_dim // a.group
    return groups & (groups - 1) == 0


def gather_rows(source: KeySource, slots: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*slots.shape, D]``: the (dequantized) row of each slot, zeros for ``-1``."""
    cache, layout = source.cache, source.layout
    flat = slots.reshape(-1).long()
    live = flat >= 0
    s = flat.clamp(min=0)
    width = layout.elements if layout is not None else cache.shape[-1]
    if flat.numel() == 0:
        return torch.zeros(*slots.shape, width, dtype=torch.float32, device=cache.device)
    if layout is not None and layout.is_quantized:
        views = split_kv_cache(cache, layout)
        bs = cache.shape[1]
        v = views.values.view(torch.uint8)[s // bs, s % bs]
        sc = views.scales.view(torch.uint8)[s // bs, s % bs]
        rows = quant.dequantize(v, sc, layout).float()
    elif cache.dim() == 2:
        rows = cache[s].float()
    else:
        rows = (
            cache.reshape(-1, cache.shape[-1])[s].float()
            if cache.is_contiguous()
            else (cache[s // cache.shape[1], s % cache.shape[1], 0].float())
        )
    rows = rows.masked_fill(~live[:, None], 0.0)
    return rows.view(*slots.shape, rows.shape[-1])
