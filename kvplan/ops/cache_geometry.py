"""Byte geometry of a KV cache and the launch-size helpers the store and load ops share.

`cache_bytes` views a cache as uint8 records and describes where each block's values and
scales start (`CacheGeometry`); `row_bases` turns slots into byte offsets (the torch paths);
`small_batch_tile` / `triton_next_pow2` size Triton programs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvplan._math import cdiv
from kvplan.formats import KVCacheFormat
from kvplan.ops._dispatch import triton_interpreting


class CacheGeometry(NamedTuple):
    """Byte addressing of a cache (see ``kvplan.ops._store_kernels`` for the formulas)."""

    num_blocks: int
    block_size: int
    block_stride: int
    v_stride: int
    s_block_off: int
    s_stride: int
    v_align: int  # power-of-two byte alignment of every value base (<= 16)
    s_align: int  # same for scale bases
    bytes_per_token: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def extent(self) -> int:
        """Bytes from the first byte of block 0 to the last record byte of the last block."""
        last = (self.num_blocks - 1) * self.block_stride
        return last + self.block_size * self.bytes_per_token


def pow2_alignment(*values: int, cap: int = 16) -> int:
    """Largest power of two <= cap dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    align = 1
    while align < cap and g % (2 * align) == 0:
        align *= 2
    return align


def cache_bytes(
    kv_cache: torch.Tensor, layout: KVCacheFormat
) -> tuple[torch.Tensor, CacheGeometry]:
    """The cache as uint8 ``[num_blocks, block_size, 1, bytes_per_token]`` and its geometry."""
    raw = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    num_blocks, block_size, _, bpt = raw.shape
    vb, sb = layout.value_bytes, layout.sf_bytes
    stride = raw.stride(0)
    if layout.token_interleaved:
        v_stride, s_off, s_stride = bpt, vb, bpt
    else:
        v_stride, s_off, s_stride = vb, block_size * vb, sb
    geo = CacheGeometry(
        num_blocks,
        block_size,
        stride,
        v_stride,
        s_off,
        s_stride,
        pow2_alignment(stride, v_stride),
        pow2_alignment(stride, s_off, s_stride) if sb else 1,
        bpt,
    )
    return raw, geo


def flat_bytes(raw: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
    """A 1-D uint8 alias of the cache starting at block 0 (torch paths index into it)."""
    return torch.as_strided(raw, (geo.extent,), (1,), raw.storage_offset())


def row_bases(slots: torch.Tensor, geo: CacheGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 byte offsets of the value and scale parts of each slot (slots must be >= 0)."""
    slots = slots.long()
    block, offset = slots // geo.block_size, slots % geo.block_size
    vbase = block * geo.block_stride + offset * geo.v_stride
    sbase = block * geo.block_stride + geo.s_block_off + offset * geo.s_stride
    return vbase, sbase


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (every dim counted, size-1 dims included)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def small_batch_tile(num_rows: int, tile: int, interpreting: bool | None = None) -> int:
    """Rows per program: ``tile`` (about 32 elements per thread) for large inputs, fewer when
    that would leave fewer than ~256 programs, so small (decode) batches finish in one short
    wave. Powers of two, at least 1. The CPU interpreter runs programs one by one, so there
    fewer, larger programs are faster and ``tile`` is kept (``interpreting``: that mode,
    read from the environment when ``None``)."""
    if triton_interpreting() if interpreting is None else interpreting:
        return max(1, tile)
    return max(1, min(tile, pow2_floor(num_rows // 256)))


def pow2_floor(v: int) -> int:
    """The largest power of two <= ``v`` (1 for ``v < 2``)."""
    return 1 << (max(v, 1).bit_length() - 1)


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


triton_cdiv = cdiv  # the name the kernels' launch code uses


# scale format -> the kernels' SF_KIND constant
SF_KIND = {"ue8m0": 0, "e4m3": 1, "fp32": 2}


def flat_groups(layout: KVCacheFormat) -> bool:
    """Whether a quantized record's scale groups tile it exactly as a power-of-two grid
    (``G`` groups of ``GS`` elements, both powers of two, ``G * GS == quantized_elements``):
    the kernels then move a record as one flat row. A row shorter than its group, or a short
    last group, takes the masked path."""
    gs, g = layout.elements_per_sf, layout.num_scales
    pow2 = gs == triton_next_pow2(gs) and g == triton_next_pow2(g)
    return pow2 and g * gs == layout.quantized_elements
