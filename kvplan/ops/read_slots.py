"""Stored K or V rows of a paged cache read back by slot, quantized records dequantized: one
kernel launch per cache.

A quantized engine cache (``kvplan.cache.KVCacheTensors`` with ``fp8`` / ``int8`` / ``fp4``)
holds per-head records (``kvplan.ops._paged_kv_tiles``). A prefill whose prompt rows attend
with SDPA or flash over the values the cache stored for them
(``kvplan.backends.fresh_prefill``) needs those rows back as bf16 ``[n, Hkv, D]``: in torch
that is a gather and the dequantization's dozen elementwise launches per cache and layer
(host time that a long prompt's step waits for); here one program per (tile of rows, head)
reads each record's value and scale runs and writes the bf16 values -- the same values the
paged attention kernels dequantize in registers (``dequantize_kv_raw``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import check_tensor
from kvplan.formats import KVCacheFormat
from kvplan.ops._launch import jit
from kvplan.ops._paged_kv_tiles import head_scales_offset, kv_geometry, load_kv_tile
from kvplan.ops._quant_triton import bf16_bits

TILE_ROWS = 32  # rows per program: 32 x 128 values is 4 KB of bf16 a program


@jit
def _read_slots_kernel(
    cache_ptr, slots_ptr, out_ptr, n, stride_b, stride_t, stride_h, sf_off,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr, KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr,
    GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    offs = pid * TILE_N + tl.arange(0, TILE_N)
    in_range = offs < n
    slot = tl.load(slots_ptr + offs, mask=in_range, other=-1).to(tl.int64)
    stored = slot >= 0  # -1: no stored row, read as zeros
    slot = tl.maximum(slot, 0)
    rows = (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_t
    like = tl.zeros([1], dtype=tl.float32)  # dequantized in fp32 (exact), rounded below
    sf_ptr = cache_ptr + sf_off + head_scales_offset(kvh, HEAD_DIM, GROUP, SF_KIND)
    tile = load_kv_tile(cache_ptr + kvh * stride_h, sf_ptr, rows, stored, like, TILE_N,
                        HEAD_DIM, True, KV_QUANT, SF_KIND, GROUP)  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    dst = out_ptr + offs.to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + kvh * HEAD_DIM
    # bf16 by integer round-to-nearest-even (the interpreter's float casts truncate)
    tl.store(dst + offs_d[None, :], bf16_bits(tile).to(tl.int16), mask=in_range[:, None])


def read_slots_triton(
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_layout: KVCacheFormat,
    head_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bf16 values ``[n, Hkv, head_dim]`` stored at ``slots`` (int ``[n]``, each in
    ``[0, num_blocks * block_size)``, slot = block * block_size + row, or -1 for a row of
    zeros; not range-checked: no sync) of a uint8 ``[num_blocks, block_size, 1, bytes_per_token]`` cache of the
    token-interleaved quantized ``kv_layout`` (per-head value runs, then per-head scale runs,
    as ``kvplan.cache.KVCacheTensors`` stores them). Bit-equal to ``kvplan.quant.dequantize``
    of the gathered records. ``out``: optional contiguous bf16 destination."""
    check_tensor("cache", cache, dtype=torch.uint8, ndim=4)
    check_tensor("slots", slots, dtype=(torch.int32, torch.int64), ndim=1, device=cache.device)
    if kv_layout.quantized_dtype is None or not kv_layout.token_interleaved:
        raise ValueError(
            f"kv_layout must be a token-interleaved quantized format, got {kv_layout!r}"
        )
    if cache.shape[2] != 1 or cache.shape[3] != kv_layout.bytes_per_token:
        raise ValueError(
            f"cache shape {tuple(cache.shape)} does not hold {kv_layout.bytes_per_token}-byte "
            "records ([num_blocks, block_size, 1, bytes_per_token])"
        )
    if kv_layout.quantized_elements % head_dim or head_dim % kv_layout.elements_per_sf:
        raise ValueError(
            f"head_dim {head_dim} must divide {kv_layout.quantized_elements} values and hold "
            f"whole groups of {kv_layout.elements_per_sf}"
        )
    geo = kv_geometry(cache, cache, head_dim, kv_layout)
    n = slots.shape[0]
    shape = (n, geo.num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=cache.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, shape=shape, device=cache.device,
                     contiguous=True)  # fmt: skip
    if n:
        grid = (triton.cdiv(n, TILE_ROWS), geo.num_kv_heads)
        _read_slots_kernel[grid](
            cache, slots, out.view(torch.int16), n, cache.stride(0), cache.stride(1), geo.stride_kh, geo.sf_off,
            BLOCK_SIZE=cache.shape[1], TILE_N=TILE_ROWS, HEAD_DIM=head_dim,
            NUM_HEADS=geo.num_kv_heads, KV_QUANT=geo.kv_quant, SF_KIND=geo.sf_kind,
            GROUP=geo.group, num_warps=4,
        )  # fmt: skip
    return out
