"""K/V tiles of the paged attention kernels: plain caches, or fp8 / int8 / fp4 pages read in
place.

A quantized cache is a uint8 ``[num_blocks, block_size, 1, bytes_per_token]`` cache of a
token-interleaved, cast-on-load ``KVCacheFormat`` over ``Hkv * D`` values. Every head's D
values are whole scale groups, so a token's record is laid out as::

    [ head 0 values | head 1 values | ... | head 0 scales | head 1 scales | ... ]
      D bytes (e4m3, int8) or D / 2 (e2m1)  (D / group) scales of 4 (fp32) or 1 byte

A kernel program owns one KV head: it reads that head's value run and scale run of each key
and dequantizes them in registers (``load_kv_tile``); ``kv_geometry`` gives the offsets.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._quant_triton import SF_KIND, decode_e2m1, decode_e2m1_tiny, pow2

E2M1_F16: tl.constexpr = tl.constexpr(4)
"""``KV_QUANT`` of e2m1 pages with e4m3 scales read as fp16 tiles (the decode kernel's
``KVPLAN_FP4_F16`` path): the geometry's 2 otherwise."""

E2M1_F16_NIB: tl.constexpr = tl.constexpr(5)
"""``KV_QUANT`` of the same pages read as fp16 tiles in nibble order (``KVPLAN_FP4_NIBBLES``):
the tiles (`e2m1_f16_tile` with ``TINY``) hold the values times 2^-14 in nibble order; the
decode kernel takes its query through `nibble_query` and its accumulator through
`nibble_acc`."""


@jit
def nibble_query(q, qk_scale):
    """An fp16 query tile ``[R, C]`` (`query_f16`) for tiles in nibble order (`e2m1_f16_tile`
    with ``TINY``): its columns permuted the same way -- column ``2i + h`` of each group of 8
    takes column ``i + 4h`` -- and the tiles' 2^-14 taken on the logits' scale (exact)."""
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    q = tl.reshape(tl.permute(tl.reshape(q, [R, C // 8, 2, 4]), (0, 1, 3, 2)), [R, C])
    return q, qk_scale * 16384.0


@jit
def nibble_acc(acc):
    """An fp32 accumulator ``[R, C]`` of products with tiles in nibble order (`nibble_query`)
    back in column order and times 2^14 (exact)."""
    R: tl.constexpr = acc.shape[0]
    C: tl.constexpr = acc.shape[1]
    return (
        tl.reshape(tl.permute(tl.reshape(acc, [R, C // 8, 4, 2]), (0, 1, 3, 2)), [R, C]) * 16384.0
    )


@jit
def _load_masked(ptrs, in_range, MASKED: tl.constexpr):
    """``tl.load`` of ``[TILE_N, C]`` pointers; masked tiles read 0 for keys out of range."""
    if MASKED:
        return tl.load(ptrs, mask=in_range[:, None], other=0)
    return tl.load(ptrs)


@jit
def load_kv_raw(
    ptr, sf_ptr, rows, in_range, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One head's K or V of ``TILE_N`` keys as stored: ``(values, scales)``. Plain caches:
    the ``[TILE_N, HEAD_DIM]`` values and a placeholder; quantized ones: the value bytes
    (``[TILE_N, HEAD_DIM]``, ``HEAD_DIM // 2`` for e2m1; ``KV_QUANT`` 4: the e2m1 bytes as
    ``HEAD_DIM // 8`` little-endian int32 words) and the ``[TILE_N, HEAD_DIM // GROUP]``
    scales (fp32, or their bytes). `dequantize_kv_raw` turns them into the tile; a caller can
    load a tile's raw bytes one step ahead of using them (a few registers a thread)."""
    if KV_QUANT >= E2M1_F16:  # fp16 tiles (E2M1_F16, E2M1_F16_NIB)
        words = (ptr + rows[:, None]).to(tl.pointer_type(tl.int32))
        vals = _load_masked(words + tl.arange(0, HEAD_DIM // 8)[None, :], in_range, MASKED)
    else:
        offs_d = tl.arange(0, HEAD_DIM // 2 if KV_QUANT == 2 else HEAD_DIM)
        vals = _load_masked(ptr + rows[:, None] + offs_d[None, :], in_range, MASKED)
    if KV_QUANT == 0:
        sf = in_range  # placeholder
    else:
        sf = load_kv_scales(sf_ptr, rows, in_range, HEAD_DIM, MASKED, SF_KIND, GROUP)
    return vals, sf


@jit
def load_kv_scales(
    sf_ptr, rows, in_range, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """The ``[TILE_N, HEAD_DIM // GROUP]`` scales of one head of ``TILE_N`` keys as stored:
    fp32, or their bytes (``SF_KIND`` values: ``kvplan.ops._quant_triton.SF_KIND``)."""
    offs_g = tl.arange(0, HEAD_DIM // GROUP)
    if SF_KIND == 2:  # fp32
        sf_rows = (sf_ptr + rows).to(tl.pointer_type(tl.float32))
        sf = _load_masked(sf_rows[:, None] + offs_g[None, :], in_range, MASKED)
    else:
        sf = _load_masked(sf_ptr + rows[:, None] + offs_g[None, :], in_range, MASKED)
    return sf


@jit
def kv_scales_fp32(sf, KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr):
    """`load_kv_raw`'s scales as fp32 factors (``SF_KIND`` as in ``kvplan.ops._quant_triton``;
    e2m1 values come 2^-14 small from ``decode_e2m1_tiny``, so their e4m3 scales take 2^14)."""
    if SF_KIND == 2:
        scale = sf
    elif SF_KIND == 1:  # e4m3
        scale = sf.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if KV_QUANT == 2:  # exact: a power-of-two factor on a value <= 448
            scale = scale * 16384.0
    else:  # UE8M0: the byte is the fp32 exponent field
        scale = (sf.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return scale


@jit
def load_kv_groups(
    ptr, sf_ptr, rows, q, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One head's e4m3 / int8 values (``KV_QUANT`` 1 / 3) of ``TILE_N`` whole-tile keys split
    by scale group, unscaled: ``[HEAD_DIM // GROUP, TILE_N, GROUP]`` in q's dtype (exact: every
    e4m3 / int8 code is a bf16 / fp16 value), and the ``[TILE_N, HEAD_DIM // GROUP]`` fp32
    scales (`kv_scales_fp32`). A caller multiplies the scales into the other operand of its
    dot (one factor per key and group), so the values reach the MMA as loaded. (e2m1 nibble
    pairs split by group this way decoded slowly on the H200: bench/RESULTS.md, session 20.)"""
    NG: tl.constexpr = HEAD_DIM // GROUP
    offs_g = tl.arange(0, NG)
    offs_c = tl.arange(0, GROUP)
    ptrs = ptr + rows[None, :, None] + (offs_g * GROUP)[:, None, None]
    raw = tl.load(ptrs + offs_c[None, None, :])
    if KV_QUANT == 1:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    sf = load_kv_scales(sf_ptr, rows, rows, HEAD_DIM, False, SF_KIND, GROUP)  # unmasked
    return x.to(q.dtype), kv_scales_fp32(sf, KV_QUANT, SF_KIND)


@jit
def e2m1_f16_tile(words, scale_bytes, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  GROUP: tl.constexpr, TINY: tl.constexpr = False):  # fmt: skip
    """``[TILE_N, HEAD_DIM // 8]`` int32 words of e2m1 nibbles (element ``2i`` in the low
    nibble of byte ``i``) times their ``[TILE_N, HEAD_DIM // GROUP]`` e4m3 scale bytes as the
    ``[TILE_N, HEAD_DIM]`` fp16 tile, exactly (`e2m1_words_f16`, then one fp16 multiply:
    ``value * scale`` has at most six significant bits and lies in [2^-10, 2,688]). ``TINY``:
    the tile times 2^-14 in nibble order (`e2m1_words_f16_tiny`), also exact: none of those
    six bits lies below 2^-10, so times 2^-14 they fit fp16 (subnormal below 2^-14, none
    below 2^-24); one fp16 multiply a value instead of two."""
    if TINY:
        x = e2m1_words_f16_tiny(words, TILE_N, HEAD_DIM)
    else:
        x = e2m1_words_f16(words, TILE_N, HEAD_DIM)
    x = tl.reshape(x, [TILE_N, HEAD_DIM // GROUP, GROUP])
    scale = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(x * scale[:, :, None], [TILE_N, HEAD_DIM])


@jit
def e2m1_words_f16(words, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``[TILE_N, HEAD_DIM // 8]`` int32 words of e2m1 nibbles (element ``2i`` in the low
    nibble of byte ``i``) as the ``[TILE_N, HEAD_DIM]`` fp16 values, exactly. Each byte's two
    nibbles go to the low bits of the two halves of an int32, and one mask-and-shift pair
    puts every code's exponent and mantissa bits where `decode_e2m1_tiny` puts them, for both
    halves at once (fp16 ``value * 2^-14``); one fp16 multiply by 2^14 makes the values.
    About five integer operations a pair of values, where a byte a register takes ten."""
    b0 = words & 0xFF
    b1 = (words >> 8) & 0xFF
    b2 = (words >> 16) & 0xFF
    b3 = (words >> 24) & 0xFF
    # byte k -> nibble 2k in bits 0-3, nibble 2k + 1 in bits 16-19
    p0 = (b0 & 0xF) | ((b0 & 0xF0) << 12)
    p1 = (b1 & 0xF) | ((b1 & 0xF0) << 12)
    p2 = (b2 & 0xF) | ((b2 & 0xF0) << 12)
    p3 = (b3 & 0xF) | ((b3 & 0xF0) << 12)
    pairs = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [TILE_N, HEAD_DIM // 8, 4])
    h = ((pairs & 0x70007) << 9) | ((pairs & 0x80008) << 12)
    lo = h.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [TILE_N, HEAD_DIM]) * 16384.0


_SIGNS: tl.constexpr = tl.constexpr(-0x7FFF8000)  # int32 0x80008000: both halves' sign bits


@jit
def e2m1_words_f16_tiny(words, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``[TILE_N, HEAD_DIM // 8]`` int32 words of e2m1 nibbles (nibble ``j`` of a word, bits
    ``4j .. 4j + 3``, is dimension ``j`` of its 8) as ``[TILE_N, HEAD_DIM]`` fp16
    ``value * 2^-14`` (`decode_e2m1_tiny`'s bits), exactly, in nibble order (column ``2i + h``
    of each 8 holds dimension ``i + 4h``): nibbles ``i`` and ``i + 4`` sit 16 bits apart, so one shift-and-mask pair per sign and per magnitude
    places both halves of an fp16 pair at once -- four integer operations a pair of values,
    with no byte extraction and no multiply."""
    h0 = ((words << 9) & 0x0E000E00) | ((words << 12) & _SIGNS)
    h1 = ((words << 5) & 0x0E000E00) | ((words << 8) & _SIGNS)
    h2 = ((words << 1) & 0x0E000E00) | ((words << 4) & _SIGNS)
    h3 = ((words >> 3) & 0x0E000E00) | (words & _SIGNS)
    pairs = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), [TILE_N, HEAD_DIM // 8, 4])
    lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [TILE_N, HEAD_DIM])


@jit
def query_f16(q, qk_scale):
    """A query tile in fp16 for fp16 products (fp16 key tiles): ``q * 2^-shift`` and
    ``qk_scale * 2^shift``, with ``shift`` putting the largest |value| in [2^14, 2^15) (so a
    small query is not left in fp16's subnormal range); exact but for values 2^24 below the
    largest. Powers of two on both sides: the same logits as the unscaled query where that
    one is exact in fp16."""
    down, up = _f16_shift(q)
    return (q.to(tl.float32) * down).to(tl.float16), qk_scale * up


@jit
def _f16_shift(q):
    """``(2^-shift, 2^shift)`` for a query tile going to fp16: ``shift`` (>= -100: an all-zero
    tile stays zero) puts its largest |value| in [2^14, 2^15)."""
    top = (tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0).to(tl.int32, bitcast=True) >> 23) & 255
    shift = tl.maximum(top - 141, -100)  # 141: the biased exponent of [2^14, 2^15)
    return pow2(-shift), pow2(shift)


@jit
def dequantize_kv_raw(
    vals, sf, q, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
    SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """`load_kv_raw`'s ``(values, scales)`` as the ``[TILE_N, HEAD_DIM]`` tile in q's dtype
    (``KV_QUANT`` as in `load_kv_tile`; 4 / 5: fp16, `e2m1_f16_tile`)."""
    if KV_QUANT == 0:
        tile = vals
    elif KV_QUANT >= E2M1_F16:  # fp16 tiles (E2M1_F16, E2M1_F16_NIB)
        tile = e2m1_f16_tile(vals, sf, TILE_N, HEAD_DIM, GROUP, KV_QUANT == E2M1_F16_NIB)
    else:
        if KV_QUANT == 1:
            x = vals.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif KV_QUANT == 3:
            x = vals.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            packed = vals.to(tl.int32)
            if SF_KIND == 1:  # the values times 2^-14; e4m3 scales (<= 448) take the 2^14
                pairs = tl.join(decode_e2m1_tiny(packed & 15), decode_e2m1_tiny(packed >> 4))
            else:
                pairs = tl.join(decode_e2m1(packed & 15), decode_e2m1(packed >> 4))
            x = tl.reshape(pairs, [TILE_N, HEAD_DIM])  # pairs: [N, D/2, 2]
        scale = kv_scales_fp32(sf, KV_QUANT, SF_KIND)
        grouped = tl.reshape(x, [TILE_N, HEAD_DIM // GROUP, GROUP]) * scale[:, :, None]
        tile = tl.reshape(grouped, [TILE_N, HEAD_DIM]).to(q.dtype)
    return tile


@jit
def load_kv_tile(
    ptr, sf_ptr, rows, in_range, q, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One head's K or V values of ``TILE_N`` keys as ``[TILE_N, HEAD_DIM]`` in q's dtype.

    ``rows``: int64 ``[TILE_N]`` offsets (elements of the cache; bytes for a quantized cache)
    of the keys' token records; ``ptr``: the cache plus the head's value offset; ``sf_ptr``
    (quantized only): the cache plus the head's scale offset. ``KV_QUANT`` 0 reads the values
    as they are; 1 (e4m3 bytes), 2 (e2m1 nibbles, element 2i in the low nibble of byte i) and
    3 (int8 two's-complement bytes) dequantize in registers: ``fp32(value) * fp32(scale)`` with one scale per ``GROUP``
    values (``SF_KIND`` as in ``kvplan.ops._quant_triton``), then one rounding to q's dtype
    -- for bf16 exactly what ``kvplan.quant.dequantize`` returns. 4 (``E2M1_F16``: e2m1 with
    e4m3 scales, an fp16 q) gives the same values in fp16 (`e2m1_f16_tile`); 5
    (``E2M1_F16_NIB``) the values times 2^-14 in fp16, the columns in nibble order
    (`e2m1_f16_tile` with ``TINY``). Every load is a
    contiguous run per key (values, then the head's scales), so the compiler can pipeline it.
    """
    vals, sf = load_kv_raw(ptr, sf_ptr, rows, in_range, HEAD_DIM, MASKED, KV_QUANT, SF_KIND,
                           GROUP)  # fmt: skip
    return dequantize_kv_raw(vals, sf, q, TILE_N, HEAD_DIM, KV_QUANT, SF_KIND, GROUP)


@jit
def head_scales_offset(kvh, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SF_KIND: tl.constexpr):
    """Bytes from the first head's scale run to head ``kvh``'s (a compile-time multiple of the
    run's size, so the compiler knows how the run is aligned)."""
    if SF_KIND == 2:
        return kvh * (HEAD_DIM // GROUP * 4)
    return kvh * (HEAD_DIM // GROUP)


_KV_QUANT = {"e4m3": 1, "e2m1": 2, "int8": 3}  # quantized_dtype -> KV_QUANT


class KVGeometry(NamedTuple):
    """How the kernels address one head's records in a cache (see ``kv_geometry``)."""

    num_kv_heads: int
    stride_kh: int  # elements (bytes when quantized) between two heads' values
    stride_vh: int
    sf_off: int  # bytes from a token record's start to its scales (quantized only)
    stride_sh: int  # bytes between two heads' scales (quantized only)
    kv_quant: int  # 0 plain, 1 e4m3, 2 e2m1, 3 int8
    sf_kind: int  # kvplan.ops._quant_triton.SF_KIND (quantized only)
    group: int  # values per scale (quantized only)


def kv_geometry(k_cache, v_cache, head_dim: int, kv_layout) -> KVGeometry:
    """Head addressing of plain ``[N, bs, Hkv, D]`` caches (``kv_layout`` None) or of uint8
    ``[N, bs, 1, bytes_per_token]`` caches of a token-interleaved quantized ``kv_layout``,
    whose record holds Hkv per-head value runs, then Hkv per-head scale runs."""
    if kv_layout is None:
        return KVGeometry(k_cache.shape[2], k_cache.stride(2), v_cache.stride(2), 0, 0, 0, 0, 1)
    fp4 = kv_layout.quantized_dtype == "e2m1"
    kv_quant = _KV_QUANT[kv_layout.quantized_dtype]
    group = kv_layout.elements_per_sf
    head_bytes = head_dim // 2 if fp4 else head_dim
    sf_size = kv_layout.sf_bytes // kv_layout.num_scales
    return KVGeometry(
        kv_layout.quantized_elements // head_dim, head_bytes, head_bytes,
        kv_layout.quantized_bytes, head_dim // group * sf_size, kv_quant,
        SF_KIND[kv_layout.sf_format], group,
    )  # fmt: skip


# Decode launch per KV format (``kv_layout.quantized_dtype``; None: float caches):
# (tile_n keys per step, num_warps, num_stages). ``bench/bench_quant_decode.py`` sweeps them;
# on the H200 (32 x 8,192 context, 8 KV heads x 64) float caches were fastest at 5 stages
# (double-buffered K/V tiles), the quantized ones at 2. Session 18 (calls D / E, `--graph`,
# llama-1b heads) added 2 warps: bf16 (64, 2, 5) against (64, 4, 5) 14.2 vs 16.8 us at
# 64 x 320 context, 40.3 vs 41.7 at 64 x 1,024, 137.6 vs 139.4 at 64 x 4,096, 141.2 vs 141.8
# at 32 x 8,192; fp8 (64, 2, 3) against (64, 4, 2) 14.9 vs 15.3, 44.9 vs 45.2, 157.6 vs 165.5,
# 156.7 vs 176.0 us; the long workload's fp8 decode step 3.658 vs 3.939 ms (call F).
# Session 19 (call A, same bench): int8 kept (64, 4, 2) (16.9 us at 64 x 320, 185.2 at
# 32 x 8,192; no swept launch was faster); fp4 (64, 2, 2) against (64, 4, 2) 18.7 vs 25.4 us
# and 189.3 vs 201.7 us. Session 20 (call B, ``--prefetch 2``): with the whole-tile loop's
# mode 2 (``DECODE_PREFETCH``) int8 (64, 2, 3) 153.6 us against (64, 4, 2) 185.8 us at 32 x 8K.
DECODE_TILING: dict[str | None, tuple[int, int, int]] = {
    None: (64, 2, 5),
    "e4m3": (64, 2, 3),
    "int8": (64, 2, 3),
    "e2m1": (64, 2, 2),
}


DECODE_TILING_HEADS: dict[tuple[str | None, int], tuple[int, int, int]] = {
    ("e4m3", 2): (32, 2, 3),
    ("e4m3", 4): (32, 4, 3),
    ("e2m1", 2): (32, 2, 3),
    ("int8", 2): (64, 2, 2),
    (None, 2): (64, 4, 3),
    (None, 4): (32, 4, 3),
}
"""Decode launches with several KV heads a program (``heads``,
``kvplan.ops._paged_attention_kernels.decode_heads``): ``(format, heads)`` -> tiling, where
`DECODE_TILING`'s entry would not fit (a tile of heads x D columns). The fastest of
``bench_quant_decode.py --tiles 32,64 --warps 2,4 --stages 3 --heads 2,4`` on the H100 (32 x
8K, llama-1b heads; bench/RESULTS.md, session 36): fp8 2 heads 145.6 us (one head, default
launch: 168.2), 4 heads 166.1; bf16 188.4 / 194.0 (196.5). Session 37 (H100, 32 x 8K,
``--tiles 32,64 --warps 2 --stages 2,3 --heads 2``): fp4 2 heads 127.2 us (one head, default
launch: 140.5; 2 heads at its 64-key tiling 177.9), int8 155.9 (166.6; its best one-head
tiling 159.0). Other formats and counts keep their `DECODE_TILING` entry."""


def _tiling_from_env() -> tuple[int, int, int] | None:
    """``KVPLAN_DECODE_TILING="tile_n,num_warps,num_stages"``: every format's decode default
    (A/B runs of whole engines); unset: ``DECODE_TILING``."""
    text = os.environ.get("KVPLAN_DECODE_TILING", "")
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"KVPLAN_DECODE_TILING must be 'tile_n,num_warps,num_stages', got {text!r}"
        )
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


TILING_OVERRIDE = _tiling_from_env()


def decode_tiling(
    kv_layout,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads: int = 1,
) -> tuple[int, int, int]:
    """``(tile_n, num_warps, num_stages)`` of a decode launch: the overrides that are given,
    else ``KVPLAN_DECODE_TILING``'s, else `DECODE_TILING_HEADS`' entry for the cache's format
    at ``heads`` KV heads a program, else ``DECODE_TILING``'s entry for the format.

    ``num_stages`` is the key loop's software-pipeline depth; the page-table load of a tile
    precedes its K/V loads, so the compiler double-buffers the K/V tiles only from 5 stages.

    >>> decode_tiling(None, num_warps=4)
    (64, 4, 5)
    """
    key = None if kv_layout is None else kv_layout.quantized_dtype
    dflt = (
        TILING_OVERRIDE
        or DECODE_TILING_HEADS.get((key, heads))
        or DECODE_TILING.get(key, DECODE_TILING[None])
    )
    tile_n = dflt[0] if tile_n is None else tile_n
    num_warps = dflt[1] if num_warps is None else num_warps
    num_stages = dflt[2] if num_stages is None else num_stages
    if not isinstance(tile_n, int) or tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n!r}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages must be an int in [1, 8], got {num_stages!r}")
    return tile_n, num_warps, num_stages


DECODE_MAXNREG: dict[str | None, int] = {"e2m1_f16": 128, "e4m3": 168, "int8": 168}
"""Register cap per thread (Triton's ``maxnreg``) of a decode launch by its
``kvplan.ops._paged_attention_kernels.decode_key`` (``kv_layout.quantized_dtype``, None for
float caches, ``"e2m1_f16"`` for fp4 pages read as fp16 tiles); absent: the compiler's own
choice. fp16 fp4 tiles compile to 128 registers in mode 2: the entry tells the split plan that
8 programs fit (session 23, 32 x 8K: 4 splits 150.6 us; 5 / 6 / 8 splits 173.5 / 160.3 /
153.4; caps 112 / 96 154.7 / 153.0). A cap
lets more programs share an SM (65,536 registers) at the price of spills. Measured on the H200
(bench/RESULTS.md, session 21, 32 x 8K, default tilings): fp8 (64, 2, 3) takes 232 registers
(4 programs an SM); at 168 it spills 24 bytes, 6 fit, and with 3 splits runs 135.1 us against
143.0 uncapped (2 splits); fp4 at 168 202.0 us (3 splits) / 240.4 (2) against 189.1, bf16
equal (137.3 vs 137.9); 128 registers spill 308 bytes (fp8 199.6 us). int8 (64, 2, 3)
compiles to 168 registers by itself: its entry only tells the split plan that 6 programs fit
(session 22, 32 x 8K: 3 splits 139.4 us against 152.3 with 2)."""


DECODE_MAXNREG_ALWAYS = frozenset({"e2m1_f16"})
"""Keys whose ``DECODE_MAXNREG`` entry applies to every launch, a given split count included
(other entries only where the cap brings extra splits: `_decode_launch_plan`). fp4 fp16 tiles
at 32 x 8K with 4 splits given (H200, bench/RESULTS.md, session 24): nibble order 139.6 us
capped against 184.1 uncapped, in order 151.0 against 151.4."""


def _maxnreg_from_env() -> int | None:
    """``KVPLAN_DECODE_MAXNREG=n``: every format's decode register cap (A/B runs of whole
    engines; 0: none); unset: ``DECODE_MAXNREG``."""
    text = os.environ.get("KVPLAN_DECODE_MAXNREG", "").strip()
    if not text:
        return None
    if not text.isdigit() or (int(text) and not 24 <= int(text) <= 255):
        raise ValueError(f"KVPLAN_DECODE_MAXNREG must be 0 or an int in [24, 255], got {text!r}")
    return int(text)


MAXNREG_OVERRIDE = _maxnreg_from_env()


def decode_maxnreg(kv_layout, maxnreg: int | None = None, key: str | None = None) -> int | None:
    """The register cap of a decode launch: ``maxnreg`` when given (0: none), else
    ``KVPLAN_DECODE_MAXNREG``, else ``DECODE_MAXNREG``'s entry for ``key`` (the launch's
    ``kvplan.ops._paged_attention_kernels.decode_key``; None: the cache's format).

    >>> decode_maxnreg(None) is None
    True
    >>> decode_maxnreg(None, 168)
    168
    """
    if maxnreg is None:
        if MAXNREG_OVERRIDE is not None:
            maxnreg = MAXNREG_OVERRIDE
        else:
            if key is None and kv_layout is not None:
                key = kv_layout.quantized_dtype
            maxnreg = DECODE_MAXNREG.get(key)
    if maxnreg is None or maxnreg == 0:
        return None
    if not isinstance(maxnreg, int) or not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg must be None, 0 or an int in [24, 255], got {maxnreg!r}")
    return maxnreg
