"""Triton kernels of ``load_paged_kv_cache``.

Grid ``(cdiv(num_segments, SEGS), cdiv(block_size, TILE_T))``: program (p, i) handles, for each
of the ``SEGS`` segments s = p * SEGS + [0, SEGS), tokens ``first + i * TILE_T + [0, TILE_T)``
with ``first = max(src_begin, 0)`` (those below ``src_end``): ``SEGS * TILE_T`` rows in all. A segment holds at most one block
(``block_size`` tokens), so with one segment per program a 132-byte index record leaves a
program only 64 x 132 = 8.4 KB to move at block size 64; ``SEGS`` lets it take several
segments. Byte addressing
of the cache is the one of ``kvplan.ops._store_kernels``. A segment with ``src_block == -1``
reads nothing and writes zeros. Rows outside the cache or the output are dropped (the host
validates plans; the masks keep an unchecked call from touching memory it does not own).
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._quant_triton import bf16_bits, decode_e2m1_tiny, decode_e4m3, scale_multipliers


@jit
def _segment_rows(seg_ptr, num_segments, num_blocks, block_size, total_k,
                  TILE_T: tl.constexpr, SEGS: tl.constexpr):  # fmt: skip
    """(write mask, read mask, source block, token in block, destination row) per program row;
    row r of the program is token ``r % TILE_T`` of its tile of segment ``r // TILE_T``."""
    r = tl.arange(0, SEGS * TILE_T)
    if SEGS == 1:
        # one segment: four scalar loads (per-row loads would repeat them for every row)
        seg = tl.program_id(0).to(tl.int64)
        has = seg < num_segments
        src = tl.load(seg_ptr + seg * 4)
        begin = tl.load(seg_ptr + seg * 4 + 1)
        end = tl.load(seg_ptr + seg * 4 + 2)
        dst = tl.load(seg_ptr + seg * 4 + 3)
    else:
        seg = tl.program_id(0).to(tl.int64) * SEGS + r // TILE_T
        has = seg < num_segments
        src = tl.load(seg_ptr + seg * 4, mask=has, other=0)
        begin = tl.load(seg_ptr + seg * 4 + 1, mask=has, other=0)
        end = tl.load(seg_ptr + seg * 4 + 2, mask=has, other=0)
        dst = tl.load(seg_ptr + seg * 4 + 3, mask=has, other=0)
    # int64: an unvalidated plan may hold any int32 (a negative src_begin starts at token 0)
    begin = begin.to(tl.int64)
    t = tl.maximum(begin, 0) + tl.program_id(1) * TILE_T + r % TILE_T
    dst_row = dst.to(tl.int64) + t - begin
    ok = has & (t < end) & (t < block_size) & (dst_row >= 0) & (dst_row < total_k)
    ok = ok & (src >= -1) & (src < num_blocks)
    read = ok & (src >= 0)
    block = tl.maximum(src, 0).to(tl.int64)
    # rows outside `ok` keep their (unused) token: every access is masked. Selecting them to 0
    # here made Triton 3.6's layout pass fail for SEGS > 1 (the row mask feeds two layouts).
    return ok, read, block, t, dst_row


@jit(sizes=("num_segments", "num_blocks", "total_k"))
def load_cast_kernel(
    cache_ptr,  # uint8, block 0 of the cache
    seg_ptr,  # int32 [num_segments, 4]
    num_segments,
    out_ptr,  # int16 view of the bf16 output [total_k, E] (row stride out_stride)
    out_stride,
    num_blocks,
    block_size,
    total_k,
    block_stride,
    v_stride,
    s_block_off,
    s_stride,
    E: tl.constexpr,
    GS: tl.constexpr,
    G: tl.constexpr,
    GS_P2: tl.constexpr,
    G_P2: tl.constexpr,
    GB: tl.constexpr,
    GB_P2: tl.constexpr,
    FP4: tl.constexpr,
    SF: tl.constexpr,
    SB: tl.constexpr,
    FLAT: tl.constexpr,  # groups tile the record exactly (GS and G powers of two)
    HW: tl.constexpr,  # hardware fp8 / bf16 conversions (GPU); integer ones in the interpreter
    TILE_T: tl.constexpr,
    SEGS: tl.constexpr,  # segments per program (power of two)
    VALIGN: tl.constexpr,
    SALIGN: tl.constexpr,
    OALIGN: tl.constexpr,
):
    """Dequantize: out[dst] = bf16(fp32(value) * fp32(scale))."""
    R: tl.constexpr = SEGS * TILE_T  # rows per program
    ok, read, block, t, dst = _segment_rows(seg_ptr, num_segments, num_blocks, block_size,
                                            total_k, TILE_T, SEGS)  # fmt: skip
    vbase = tl.multiple_of(block * block_stride + t * v_stride, VALIGN)
    sbase = tl.multiple_of(block * block_stride + s_block_off + t * s_stride, SALIGN)
    g = tl.arange(0, G_P2)
    if FLAT:
        j = tl.arange(0, G_P2 * GB_P2)
        vb = tl.load(cache_ptr + vbase[:, None] + j[None, :], mask=read[:, None], other=0)
        vb = tl.reshape(vb, [R, G_P2, GB_P2])
    else:
        b = tl.arange(0, GB_P2)
        bidx = g[:, None] * GB + b[None, :]
        bmask = (g[:, None] < G) & (b[None, :] < GB)
        ptr = cache_ptr + vbase[:, None, None] + bidx[None, :, :]
        vb = tl.load(ptr, mask=read[:, None, None] & bmask[None, :, :], other=0)
    # vb: uint8 [R, G_P2, GB_P2], zero for rows that do not read
    if FP4:
        vb = vb.to(tl.int32)
        codes = tl.reshape(tl.join(vb & 15, vb >> 4), [R, G_P2, GS_P2])
        vals = decode_e2m1_tiny(codes)  # value * 2^-14
    elif HW:
        vals = vb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        vals = decode_e4m3(vb.to(tl.int32))
    js = tl.arange(0, G_P2 * SB)
    sb = tl.load(cache_ptr + sbase[:, None] + js[None, :], mask=read[:, None] & (js < G * SB)[None, :], other=0)  # fmt: skip
    sb = sb.to(tl.int32)
    if SB == 4:
        sb = tl.reshape(sb, [R, G_P2, 4])
    mult = scale_multipliers(sb, SF)  # [R, G_P2]
    if FP4:
        if SF == 1:  # e4m3 scales <= 448: the 2^14 folds into them without overflow
            mult = mult * 16384.0
        else:
            vals = vals * 16384.0
    y = vals * mult[:, :, None]  # [R, G_P2, GS_P2] fp32
    if HW:
        bits = y.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        bits = bf16_bits(y).to(tl.int16)
    obase = tl.multiple_of(dst * out_stride, OALIGN)
    if FLAT:
        e = tl.arange(0, G_P2 * GS_P2)
        flat = tl.reshape(bits, [R, G_P2 * GS_P2])
        tl.store(out_ptr + obase[:, None] + e[None, :], flat, mask=ok[:, None])
    else:
        k = tl.arange(0, GS_P2)
        elem = g[:, None] * GS + k[None, :]
        emask = (g[:, None] < G) & (k[None, :] < GS) & (elem < E)
        ptr = out_ptr + obase[:, None, None] + elem[None, :, :]
        tl.store(ptr, bits, mask=ok[:, None, None] & emask[None, :, :])


@jit(sizes=("num_segments", "num_blocks", "total_k"))
def load_raw_kernel(
    cache_ptr,  # uint8, block 0 of the cache
    seg_ptr,  # int32 [num_segments, 4]
    num_segments,
    outv_ptr,  # uint8 view of the values output, row stride outv_stride bytes
    outv_stride,
    outs_ptr,  # uint8 view of the scales output (unused without scales)
    outs_stride,
    num_blocks,
    block_size,
    total_k,
    block_stride,
    v_stride,
    s_block_off,
    s_stride,
    VB: tl.constexpr,  # value bytes per token
    VCOLS: tl.constexpr,  # power of two, value bytes per inner step
    SB_IN: tl.constexpr,  # scale bytes per token in the cache (0: no scales)
    SB_OUT: tl.constexpr,  # scale bytes per output row (zero padded, e.g. UE8M0 to int32s)
    SCOLS: tl.constexpr,  # next power of two of SB_OUT
    TILE_T: tl.constexpr,
    SEGS: tl.constexpr,  # segments per program (power of two)
    VALIGN: tl.constexpr,
    SALIGN: tl.constexpr,
    OVALIGN: tl.constexpr,
    OSALIGN: tl.constexpr,
):
    """Copy raw record bytes (index caches and BF16 caches) into contiguous outputs."""
    ok, read, block, t, dst = _segment_rows(seg_ptr, num_segments, num_blocks, block_size,
                                            total_k, TILE_T, SEGS)  # fmt: skip
    vbase = tl.multiple_of(block * block_stride + t * v_stride, VALIGN)
    obase = tl.multiple_of(dst * outv_stride, OVALIGN)
    for c0 in tl.static_range(0, VB, VCOLS):
        j = c0 + tl.arange(0, VCOLS)
        if VB % VCOLS == 0:
            v = tl.load(cache_ptr + vbase[:, None] + j[None, :], mask=read[:, None], other=0)
            tl.store(outv_ptr + obase[:, None] + j[None, :], v, mask=ok[:, None])
        else:
            cm = (j < VB)[None, :]
            v = tl.load(cache_ptr + vbase[:, None] + j[None, :], mask=read[:, None] & cm, other=0)
            tl.store(outv_ptr + obase[:, None] + j[None, :], v, mask=ok[:, None] & cm)
    if SB_IN > 0:
        sbase = tl.multiple_of(block * block_stride + s_block_off + t * s_stride, SALIGN)
        osbase = tl.multiple_of(dst * outs_stride, OSALIGN)
        j = tl.arange(0, SCOLS)
        smask = read[:, None] & (j < SB_IN)[None, :]
        s = tl.load(cache_ptr + sbase[:, None] + j[None, :], mask=smask, other=0)
        tl.store(
            outs_ptr + osbase[:, None] + j[None, :], s, mask=ok[:, None] & (j < SB_OUT)[None, :]
        )
