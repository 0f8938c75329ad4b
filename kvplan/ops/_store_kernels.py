"""Triton kernels of ``store_kv_cache``: quantize + scatter by slot, and the raw BF16 scatter.

Both address the cache as bytes. A token's value bytes start at
``block * block_stride + offset * v_stride`` and its scale bytes at
``block * block_stride + s_block_off + offset * s_stride`` (token-interleaved: v_stride =
s_stride = bytes_per_token, s_block_off = value_bytes; split: v_stride = value_bytes,
s_stride = sf_bytes, s_block_off = block_size * value_bytes). ``VALIGN`` / ``SALIGN`` are the
byte alignments the host proved for those addresses, so contiguous rows compile to 16-byte
vector accesses. Rows whose slot is -1 (or outside ``[0, num_slots)``) write nothing.
Non-finite inputs follow ``kvplan.quant``'s rule (scale from the finite values, +-inf ->
+-QMAX, NaN -> +0); the BF16 scatter copies them bit for bit.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from kvplan.ops._launch import jit
from kvplan.ops._quant_triton import (
    INT8_RNE_BITS,
    INT8_RNE_MAGIC,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1_magnitude_raw,
    encode_e4m3,
    encode_int8,
    pow2,
    ue8m0_exponent,
)


@jit
def _row_bases(slot_ptr, rows, n, num_slots, BLOCK_SIZE: tl.constexpr, block_stride, v_stride,
               s_block_off, s_stride, VALIGN: tl.constexpr, SALIGN: tl.constexpr):  # fmt: skip
    """Per-row (write mask, value byte base, scale byte base) for the rows of this program."""
    in_range = rows < n
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1)
    ok = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    block = (slot // BLOCK_SIZE).to(tl.int64)
    offset = (slot % BLOCK_SIZE).to(tl.int64)
    vbase = tl.multiple_of(block * block_stride + offset * v_stride, VALIGN)
    sbase = tl.multiple_of(block * block_stride + s_block_off + offset * s_stride, SALIGN)
    return ok, vbase, sbase


@jit
def _group_scales(amax, QMAX: tl.constexpr, SF: tl.constexpr, HW: tl.constexpr):
    """amax [R, G] -> (factor [R, G], scale bytes [R, G] or [R, G, 4]).

    ``factor`` multiplies the values (ue8m0: 2^-e; e4m3: fp32(1 / sf)), except for fp32 scales
    where it is ``sf`` itself and the values are divided by it (see ``kvplan.quant``).
    """
    if SF == 0:
        exp = ue8m0_exponent(amax, QMAX)
        return pow2(-exp), exp + 127
    elif SF == 1:
        sf = tl.div_rn(tl.maximum(amax, QMAX * 0.001953125), amax * 0 + QMAX)
        sf = tl.minimum(sf, 448.0)
        if HW:
            sf8 = sf.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            sbytes = sf8.to(tl.uint8, bitcast=True).to(tl.int32)
            sf_val = sf8.to(tl.float32)
        else:
            sbytes = encode_e4m3(sf)
            sf_val = decode_e4m3(sbytes)
        return tl.div_rn(sf_val * 0 + 1.0, sf_val), sbytes
    else:
        sf = tl.div_rn(tl.maximum(amax, 1e-4), amax * 0 + QMAX)
        return sf, _fp32_bytes(sf)


@jit
def _fp32_bytes(sf):
    """fp32 scales [R, G] -> their little-endian bytes [R, G, 4] (int32)."""
    shifts = tl.arange(0, 4) * 8
    return (sf.to(tl.int32, bitcast=True)[:, :, None] >> shifts[None, None, :]) & 255


@jit
def _scales_of(x, amax, QMAX: tl.constexpr, SF: tl.constexpr, SEARCH: tl.constexpr,
               HW: tl.constexpr, FAST_DIV: tl.constexpr):  # fmt: skip
    """`_group_scales` of groups ``x [R, G, K]`` (finite fp32 BF16 values, zeros in padding)
    with maxima ``amax [R, G]``; ``SEARCH`` (e4m3 values, fp32 scales): the searched scale."""
    if SEARCH:
        sf = _searched_sf(x, amax, HW)
        return sf, _fp32_bytes(sf)
    return _group_scales(amax, QMAX, SF, HW)


@jit
def _searched_sf(x, amax, HW: tl.constexpr):
    """The searched fp32 scale of each group (``kvplan.quant``, "Searched fp32 scale"): the
    first of ``a / c``, ``c`` = 448, 416, ..., 256, 240, 224, with the least int32 error
    ``sum(((|D - X| * |X|) >> 10)^2)`` in the group's fixed point (exact: integer sums do not
    depend on the order)."""
    a = tl.maximum(amax, 1e-4)
    p = _fixed_point_scale(a)
    x_abs = tl.abs(_rint(x * p[:, :, None]))  # exact products (p a power of two)
    best_sf = tl.div_rn(a, a * 0 + 448.0)
    best_err = _fp8_error(x, x_abs, a, 448.0, best_sf, p, HW)
    # a loop, not unrolled: nine unrolled candidates held ~3x the registers of the plain store
    # (the fused qkv epilogue: 243 vs 72 a thread on sm_90), and those limit every program
    for i in range(1, 9):  # 416, 384, ..., 256, then 240, 224
        c = 448.0 - 32.0 * tl.minimum(i, 6) - 16.0 * tl.maximum(i - 6, 0)
        sf = tl.div_rn(a, a * 0 + c)
        err = _fp8_error(x, x_abs, a, c, sf, p, HW)
        better = err < best_err  # ties keep the earlier candidate
        best_sf = tl.where(better, sf, best_sf)
        best_err = tl.where(better, err, best_err)
    return best_sf


@jit
def _fixed_point_scale(a):
    """``P = 2^(12 - r)`` of the scale search, ``r`` the unbiased exponent of ``a > 0``."""
    return pow2(12 - ((a.to(tl.int32, bitcast=True) >> 23) - 127))


@jit
def _searched_e4m3_code(lo, hi, amax, base):
    """The searched e4m3 scale codes of e2m1 groups (``kvplan.quant.searched_e4m3_scales``):
    ``lo`` / ``hi`` [R, G, GB] the finite fp32 elements (even / odd), ``base`` [R, G] the plain
    rule's codes; the first of ``base + (0, 1, ..., 8, -1)`` (clamped to 1..126) with the least
    int32 error in the group's fixed point."""
    p = _fixed_point_scale(tl.maximum(amax, 1e-4))
    lo_fix = tl.abs(_rint(lo * p[:, :, None]))  # exact products (p a power of two)
    hi_fix = tl.abs(_rint(hi * p[:, :, None]))
    best = base
    best_err = _fp4_error(lo, hi, lo_fix, hi_fix, base, p)
    for k in range(1, 10):  # steps 1..8, then -1 (not unrolled: registers)
        code = tl.minimum(tl.maximum(base + (k - 10 * (k // 9)), 1), 126)
        err = _fp4_error(lo, hi, lo_fix, hi_fix, code, p)
        better = err < best_err
        best = tl.where(better, code, best)
        best_err = tl.where(better, err, best_err)
    return best


@jit
def _fp4_error(lo, hi, lo_fix, hi_fix, code, p):
    """``sum(((|D - X| * X) >> 14)^2)`` of both halves of each group under the e4m3 scale
    ``code`` (``X = |rint(x * p)|``, ``D = rint(e2m1(x * (1 / sf)) * sf * p)``, exact)."""
    sf = decode_e4m3(code)
    inv = tl.div_rn(sf * 0 + 1.0, sf)[:, :, None]
    sp = (sf * p)[:, :, None]
    return tl.sum(_fp4_term(lo, lo_fix, inv, sp), axis=2) + tl.sum(
        _fp4_term(hi, hi_fix, inv, sp), axis=2
    )


@jit
def _fp4_term(x, x_fix, inv, sp):
    mag = decode_e2m1(encode_e2m1_magnitude_raw(x * inv) & 7)
    t = (tl.abs(_rint(mag * sp) - x_fix) * x_fix) >> 14
    return t * t


@jit
def _rint(v):
    """fp32 ``v`` (``|v| <= 2^22``) -> int32, rounded half to even: one IEEE addition of 1.5 *
    2^23 rounds it (the product before it is rounded on its own: ``mul_rn`` on the GPU, where
    a plain product could be contracted into that addition)."""
    return (v + INT8_RNE_MAGIC).to(tl.int32, bitcast=True) - INT8_RNE_BITS


@jit
def _fp8_error(x, x_abs, a, c, sf, p, HW: tl.constexpr):
    """``sum(((||D| - |X|| * |X|) >> 10)^2)`` over each group: ``D = rint(e4m3(x * (c / a)) *
    (sf * p))``, the candidate's rounding in the group's fixed point (D keeps x's sign, so
    the magnitudes give ``|D - X|``)."""
    y = x * tl.div_rn(a * 0 + c, a)[:, :, None]
    if HW:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        v = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        v = decode_e4m3(encode_e4m3(y))
    sp = (sf * p)[:, :, None]
    d_fix = _rint(libdevice.mul_rn(v, tl.broadcast_to(sp, v.shape)) if HW else v * sp)
    t = (tl.abs(tl.abs(d_fix) - x_abs) * x_abs) >> 10
    return tl.sum(t * t, axis=2)


INF_BITS = tl.constexpr(0x7F800000)  # int32 bits of +inf; larger |x| bits are NaN


@jit
def _finite_bits(b):
    """Magnitude bits ``b`` with inf and NaN replaced by 0 (they do not count for amax)."""
    return tl.where(b < INF_BITS, b, 0)


@jit
def _scaled(v, factor, SF: tl.constexpr, FAST_DIV: tl.constexpr):
    """v [R, G, K] scaled by its group's factor [R, G] (fp32 scales: divided by it)."""
    if SF == 2:
        if FAST_DIV:
            return _div_rn_by_group(v, factor)
        return tl.div_rn(v, tl.broadcast_to(factor[:, :, None], v.shape))
    return v * factor[:, :, None]


@jit
def _div_rn_by_group(a, b):
    """``div.rn(a, b[:, :, None])`` for a [R, G, K] and b [R, G] > 0 normal (GPU only).

    ``div.rn.f32`` compiles (sm_90 SASS) to a fast path -- r0 = MUFU.RCP(b);
    r = fma(r0, fma(r0, -b, 1), r0); q0 = a * r; q = fma(r, fma(q0, -b, a), q0) -- guarded per
    element by FCHK, which sends a / b to a slow subroutine when it could over/underflow. The
    fast path's reciprocal depends only on the group's scale, so it is computed once per group
    here and each element costs one FMUL and two FFMA instead of ~15 instructions and a
    divergent branch. Results equal div.rn wherever FCHK passes. Where it would not, here
    (b = max(amax, 1e-4) / 448 is normal and |a| <= 448 b) that is only for |a| tiny or
    subnormal: |a / b| < 2^-100, which any e4m3 / e2m1 code rounds to a signed zero; the sign
    is forced to a's (a - 0 product could otherwise give +0 for a = -0). ``a`` is finite (the
    caller zeroes non-finite inputs first).
    """
    r0 = tl.inline_asm_elementwise(
        "rcp.approx.f32 $0, $1;", "=r,r", [b], dtype=tl.float32, is_pure=True, pack=1
    )
    r = tl.fma(r0, tl.fma(r0, -b, 1.0), r0)  # [R, G]
    r = tl.broadcast_to(r[:, :, None], a.shape)
    bb = tl.broadcast_to(b[:, :, None], a.shape)
    q0 = a * r
    q = tl.fma(r, tl.fma(q0, -bb, a), q0)
    sign = a.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@jit
def e2m1_record(w, ok, QMAX: tl.constexpr, SF: tl.constexpr, SEARCH: tl.constexpr,
                HW: tl.constexpr, FAST_DIV: tl.constexpr):  # fmt: skip
    """The e2m1 bytes and scale bytes of ``w`` [R, G, GB] int32 words, each two bf16 values
    (element ``2i`` in the low half, ``2i + 1`` in the high half: one output byte), groups of
    ``2 GB`` values along axis 1; ``ok`` [R]: the rows that are written (their non-finite
    values choose the rare path for all). Returns (value bytes [R, G, GB] uint8, scale bytes
    [R, G] (or [R, G, 4] for fp32 scales)). Shared by `store_quant_kernel` and the fused qkv
    epilogue's store (``kvplan.models._fused_kernels``): the same bits by construction."""
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    lo_b = (w << 16) & 0x7FFFFFFF  # |lo| as int32 bits: ordered like the magnitudes,
    hi_b = w & 0x7FFF0000  # inf = INF_BITS, NaN above
    amax_b = tl.max(tl.maximum(lo_b, hi_b), axis=2)  # [R, G]
    signs = ((w >> 12) & 0x8) | ((w >> 24) & 0x80)  # bf16 sign bits -> nibble sign bits
    nonfinite = tl.max(tl.where(ok[:, None], amax_b, 0)) >= INF_BITS  # any row written
    if nonfinite:  # (uniform branch, rare): scale from the finite values, NaN -> +0
        lo = tl.where(lo_b < INF_BITS, lo, 0.0)
        hi = tl.where(hi_b < INF_BITS, hi, 0.0)
        amax_b = tl.max(tl.maximum(_finite_bits(lo_b), _finite_bits(hi_b)), axis=2)
        nan_signs = tl.where(lo_b > INF_BITS, 0x8, 0) | tl.where(hi_b > INF_BITS, 0x80, 0)
        signs = signs & ~nan_signs
    amax = amax_b.to(tl.float32, bitcast=True)
    factor, sbytes = _group_scales(amax, QMAX, SF, HW)
    if SEARCH:  # e4m3 scales (validated by KVCacheFormat)
        sbytes = _searched_e4m3_code(lo, hi, amax, sbytes)
        sf = decode_e4m3(sbytes)
        factor = tl.div_rn(sf * 0 + 1.0, sf)
    q_lo = _scaled(lo, factor, SF, FAST_DIV)
    q_hi = _scaled(hi, factor, SF, FAST_DIV)
    if nonfinite:
        q_lo = tl.where(lo_b == INF_BITS, QMAX, q_lo)  # magnitudes only: the sign is apart
        q_hi = tl.where(hi_b == INF_BITS, QMAX, q_hi)
    raw_lo = encode_e2m1_magnitude_raw(q_lo)
    raw_hi = encode_e2m1_magnitude_raw(q_hi)
    return (((raw_lo | (raw_hi << 4)) & 0x77) | signs).to(tl.uint8), sbytes


@jit(sizes=("n", "num_slots"))
def store_quant_kernel(
    x_ptr,  # bf16 [n, E] contiguous; int32 [n, E // 2] (bf16 pairs) when FP4
    slot_ptr,  # int32 [n]
    cache_ptr,  # uint8, block 0 of the cache
    n,
    num_slots,
    block_stride,
    v_stride,
    s_block_off,
    s_stride,
    BLOCK_SIZE: tl.constexpr,
    E: tl.constexpr,  # elements per token
    GS: tl.constexpr,  # elements per scale
    G: tl.constexpr,  # scales per token
    GS_P2: tl.constexpr,
    G_P2: tl.constexpr,
    GB: tl.constexpr,  # value bytes per group
    GB_P2: tl.constexpr,
    QB: tl.constexpr,  # value bytes per token
    FP4: tl.constexpr,  # e2m1 values (else e4m3 or int8)
    INT8: tl.constexpr,  # int8 values (fp32 scales only)
    QMAX: tl.constexpr,  # 6.0 (e2m1), 448.0 (e4m3) or 127.0 (int8)
    SF: tl.constexpr,  # 0 ue8m0, 1 e4m3, 2 fp32
    SB: tl.constexpr,  # bytes per scale
    SEARCH: tl.constexpr,  # searched scales (KVCacheFormat.scale_search)
    FLAT: tl.constexpr,  # groups tile the record exactly (GB and G powers of two)
    HW: tl.constexpr,  # hardware fp8 conversion (GPU); integer rounding in the interpreter
    FAST_DIV: tl.constexpr,  # fp32 scales: per-group reciprocal + fma correction (GPU only)
    ROWS: tl.constexpr,
    VALIGN: tl.constexpr,
    SALIGN: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok, vbase, sbase = _row_bases(slot_ptr, rows, n, num_slots, BLOCK_SIZE, block_stride,
                                  v_stride, s_block_off, s_stride, VALIGN, SALIGN)  # fmt: skip
    row_in = rows < n
    rows64 = rows.to(tl.int64)
    g = tl.arange(0, G_P2)
    b = tl.arange(0, GB_P2)
    if FP4:
        # one int32 = elements 2i (low half) and 2i + 1 (high half) = one output byte
        if FLAT:
            j = tl.arange(0, G_P2 * GB_P2)
            w = tl.load(x_ptr + rows64[:, None] * (E // 2) + j[None, :], mask=row_in[:, None])
            w = tl.reshape(w, [ROWS, G_P2, GB_P2])
        else:
            widx = g[:, None] * GB + b[None, :]
            wmask = (g[:, None] < G) & (b[None, :] < GB) & (widx < E // 2)
            w_off = rows64[:, None, None] * (E // 2) + widx[None, :, :]
            w = tl.load(x_ptr + w_off, mask=row_in[:, None, None] & wmask[None, :, :], other=0)
        vbytes, sbytes = e2m1_record(w, ok, QMAX, SF, SEARCH, HW, FAST_DIV)
    else:
        if FLAT:
            j = tl.arange(0, G_P2 * GS_P2)
            x = tl.load(x_ptr + rows64[:, None] * E + j[None, :], mask=row_in[:, None])
            x = tl.reshape(x, [ROWS, G_P2, GS_P2]).to(tl.float32)
        else:
            elem = g[:, None] * GS + b[None, :]  # GB == GS for e4m3 / int8
            emask = (g[:, None] < G) & (b[None, :] < GS) & (elem < E)
            x_off = rows64[:, None, None] * E + elem[None, :, :]
            x = tl.load(x_ptr + x_off, mask=row_in[:, None, None] & emask[None, :, :], other=0.0)
            x = x.to(tl.float32)
        xb = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| bits (inf = INF_BITS, NaN above)
        amax_b = tl.max(xb, axis=2)  # [ROWS, G_P2]
        nonfinite = tl.max(tl.where(ok[:, None], amax_b, 0)) >= INF_BITS
        x_raw = x
        if nonfinite:  # (uniform branch, rare): scale from the finite values, NaN -> +0
            x = tl.where(xb < INF_BITS, x, 0.0)
            amax_b = tl.max(_finite_bits(xb), axis=2)
        amax = amax_b.to(tl.float32, bitcast=True)
        factor, sbytes = _scales_of(x, amax, QMAX, SF, SEARCH, HW, FAST_DIV)
        q = _scaled(x, factor, SF, FAST_DIV)
        if nonfinite:  # +-inf -> +-QMAX
            q = tl.where(xb == INF_BITS, tl.where(x_raw > 0, QMAX, -QMAX), q)
        if INT8:
            vbytes = (encode_int8(q) & 255).to(tl.uint8)  # two's complement bytes
        elif HW:
            # hardware cvt (RNE, satfinite); only the ue8m0 scale keeps |q| <= 448 by itself
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
        bidx = g[:, None] * GB + b[None, :]
        bmask = (g[:, None] < G) & (b[None, :] < GB) & (bidx < QB)
        ptr = cache_ptr + vbase[:, None, None] + bidx[None, :, :]
        tl.store(ptr, vbytes, mask=ok[:, None, None] & bmask[None, :, :])
    sflat = tl.reshape(sbytes, [ROWS, G_P2 * SB]).to(tl.uint8)
    j = tl.arange(0, G_P2 * SB)
    tl.store(cache_ptr + sbase[:, None] + j[None, :], sflat, mask=ok[:, None] & (j < G * SB))


@jit(sizes=("n", "num_slots"))
def scatter_rows_kernel(
    src_ptr,  # uint8 [n, ROW_BYTES], contiguous
    slot_ptr,  # int32 [n]
    cache_ptr,  # uint8, block 0 of the cache
    n,
    num_slots,
    block_stride,
    v_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    COLS: tl.constexpr,  # power of two, bytes per inner step
    ROWS: tl.constexpr,
    VALIGN: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
):
    """Copy row i of ``src`` to the value bytes of slot ``slot[i]`` (BF16 caches)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok, vbase, _ = _row_bases(slot_ptr, rows, n, num_slots, BLOCK_SIZE, block_stride,
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
