"""Triton kernels of ``store_kv_cache``: quantize + scatter by slot, and the raw BF16 scatter.

Both address the cache as bytes. A token's value bytes start at
``block * block_stride + offset * v_stride`` and its scale bytes at
``block * block_stride + s_block_off + offset * s_stride`` (token-interleaved: v_stride =
s_stride = bytes_per_token, s_block_off = value_bytes; split: v_stride = value_bytes,
s_stride = sf_bytes, s_block_off = block_size * value_bytes). ``VALIGN`` / ``SALIGN`` are the
byte alignments the host proved for those addresses, so contiguous rows compile to 16-byte
vector accesses. Rows whose slot is -1 (or outside ``[0, num_slots)``) write nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.ops._quant_triton import (
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
    pow2,
    ue8m0_exponent,
)


@triton.jit
def _row_bases(slot_ptr, rows, n, num_slots, block_size, block_stride, v_stride, s_block_off,
               s_stride, VALIGN: tl.constexpr, SALIGN: tl.constexpr):  # fmt: skip
    """Per-row (write mask, value byte base, scale byte base) for the rows of this program."""
    in_range = rows < n
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1)
    ok = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    block = (slot // block_size).to(tl.int64)
    offset = (slot % block_size).to(tl.int64)
    vbase = tl.multiple_of(block * block_stride + offset * v_stride, VALIGN)
    sbase = tl.multiple_of(block * block_stride + s_block_off + offset * s_stride, SALIGN)
    return ok, vbase, sbase


@triton.jit
def store_quant_kernel(
    x_ptr,  # bf16 [n, E], contiguous
    slot_ptr,  # int32 [n]
    cache_ptr,  # uint8, block 0 of the cache
    n,
    num_slots,
    block_size,
    block_stride,
    v_stride,
    s_block_off,
    s_stride,
    E: tl.constexpr,  # elements per token
    GS: tl.constexpr,  # elements per scale
    G: tl.constexpr,  # scales per token
    GS_P2: tl.constexpr,
    G_P2: tl.constexpr,
    GB: tl.constexpr,  # value bytes per group
    GB_P2: tl.constexpr,
    QB: tl.constexpr,  # value bytes per token
    FP4: tl.constexpr,  # e2m1 values (else e4m3)
    QMAX: tl.constexpr,  # 6.0 (e2m1) or 448.0 (e4m3)
    SF: tl.constexpr,  # 0 ue8m0, 1 e4m3, 2 fp32
    SB: tl.constexpr,  # bytes per scale
    FLAT: tl.constexpr,  # groups tile the record exactly (GB and G powers of two)
    HW: tl.constexpr,  # hardware fp8 conversion (GPU); integer rounding in the interpreter
    ROWS: tl.constexpr,
    VALIGN: tl.constexpr,
    SALIGN: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok, vbase, sbase = _row_bases(slot_ptr, rows, n, num_slots, block_size, block_stride,
                                  v_stride, s_block_off, s_stride, VALIGN, SALIGN)  # fmt: skip
    g = tl.arange(0, G_P2)
    row_in = rows < n
    if FLAT:
        j = tl.arange(0, G_P2 * GS_P2)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * E + j[None, :], mask=row_in[:, None])
        x = tl.reshape(x, [ROWS, G_P2, GS_P2]).to(tl.float32)
    else:
        k = tl.arange(0, GS_P2)
        elem = g[:, None] * GS + k[None, :]  # [G_P2, GS_P2]
        emask = (g[:, None] < G) & (k[None, :] < GS) & (elem < E)
        x_off = rows.to(tl.int64)[:, None, None] * E + elem[None, :, :]
        x_mask = row_in[:, None, None] & emask[None, :, :]
        x = tl.load(x_ptr + x_off, mask=x_mask, other=0.0).to(tl.float32)
    # x: [ROWS, G_P2, GS_P2] fp32, zero outside the record
    amax = tl.max(tl.abs(x), axis=2)  # [ROWS, G_P2]
    if SF == 0:
        exp = ue8m0_exponent(amax, QMAX)
        q = x * pow2(-exp)[:, :, None]
        sbytes = exp + 127  # [ROWS, G_P2]
    elif SF == 1:
        sf = tl.minimum(tl.div_rn(tl.maximum(amax, QMAX * 0.001953125), amax * 0 + QMAX), 448.0)
        sbytes = encode_e4m3(sf)
        sf_val = decode_e4m3(sbytes)
        inv = tl.div_rn(sf_val * 0 + 1.0, sf_val)
        q = x * inv[:, :, None]
    else:
        sf = tl.div_rn(tl.maximum(amax, 1e-4), amax * 0 + QMAX)
        q = tl.div_rn(x, tl.broadcast_to(sf[:, :, None], x.shape))
        bits = sf.to(tl.int32, bitcast=True)
        shifts = tl.arange(0, 4) * 8
        sbytes = (bits[:, :, None] >> shifts[None, None, :]) & 255  # [ROWS, G_P2, 4]
    if FP4:
        codes = encode_e2m1(q)
        lo, hi = tl.split(tl.reshape(codes, [ROWS, G_P2, GS_P2 // 2, 2]))
        vbytes = lo | (hi << 4)  # [ROWS, G_P2, GB_P2]
        vbytes = vbytes.to(tl.uint8)
    elif HW:
        # hardware cvt (RNE, satfinite); only the ue8m0 scale keeps |q| <= 448 by construction
        if SF != 0:
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        vbytes = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        vbytes = encode_e4m3(q).to(tl.uint8)  # [ROWS, G_P2, GB_P2]
    if FLAT:
        # whole record contiguous: one flat, vectorizable row of QB bytes
        j = tl.arange(0, G_P2 * GB_P2)
        flat = tl.reshape(vbytes, [ROWS, G_P2 * GB_P2])
        tl.store(cache_ptr + vbase[:, None] + j[None, :], flat, mask=ok[:, None])
    else:
        b = tl.arange(0, GB_P2)
        bidx = g[:, None] * GB + b[None, :]
        bmask = (g[:, None] < G) & (b[None, :] < GB) & (bidx < QB)
        ptr = cache_ptr + vbase[:, None, None] + bidx[None, :, :]
        tl.store(ptr, vbytes, mask=ok[:, None, None] & bmask[None, :, :])
    sflat = tl.reshape(sbytes, [ROWS, G_P2 * SB]).to(tl.uint8)
    j = tl.arange(0, G_P2 * SB)
    tl.store(cache_ptr + sbase[:, None] + j[None, :], sflat, mask=ok[:, None] & (j < G * SB))


@triton.jit
def scatter_rows_kernel(
    src_ptr,  # uint8 [n, ROW_BYTES], contiguous
    slot_ptr,  # int32 [n]
    cache_ptr,  # uint8, block 0 of the cache
    n,
    num_slots,
    block_size,
    block_stride,
    v_stride,
    ROW_BYTES: tl.constexpr,
    COLS: tl.constexpr,  # power of two, bytes per inner step
    ROWS: tl.constexpr,
    VALIGN: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
):
    """Copy row i of ``src`` to the value bytes of slot ``slot[i]`` (BF16 caches)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok, vbase, _ = _row_bases(slot_ptr, rows, n, num_slots, block_size, block_stride,
                              v_stride, 0, 0, VALIGN, 1)  # fmt: skip
    src_base = tl.multiple_of(rows.to(tl.int64) * ROW_BYTES, SRC_ALIGN)
    for c0 in tl.static_range(0, ROW_BYTES, COLS):
        j = c0 + tl.arange(0, COLS)
        if ROW_BYTES % COLS == 0:
            m = ok[:, None]
        else:
            m = ok[:, None] & (j < ROW_BYTES)[None, :]
        v = tl.load(src_ptr + src_base[:, None] + j[None, :], mask=m)
        tl.store(cache_ptr + vbase[:, None] + j[None, :], v, mask=m)
