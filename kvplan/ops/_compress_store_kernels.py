"""Triton kernel of ``kvplan.ops.compress_store``: pool -> RMSNorm -> RoPE -> quantize -> store.

One program per closing entry ``e`` (``pid < num_entries``) and, when the state ring is written
in the same launch, one per step row ``t`` (``pid = num_entries + t``).

Entry program (window of ``R`` rows, index space ``[state ring | step rows]``, ``-1`` empty)::

    g[i, c] = gate of window row i (ring row or step row; CSA: rows < r read the "Ca" half
              [0, C), rows >= r the "Cb" half [C, 2C); empty rows -inf); with ``BIAS`` a
              step row t reads fp32(gate[t, col]) + bias[pos[t] mod r, col] (floor modulo)
    w       = softmax over i of g (fp32, max / sum / weights in three passes over the rows)
    x[c]    = sum_i round(kv[i, c] * round(w[i, c]))        round = the model dtype's rounding
    y       = round(norm_weight * (round(x) * rsqrt(mean(round(x)^2) + eps)))
    y[2i], y[2i+1] of the rotary pairs (the trailing RD channels) rotated by position * inv_freq
    stored at slot[e] in the cache's format (``-1`` stores nothing and skips the work)

``round`` is the identity for fp32 models and RNE to BF16 for BF16 models (explicit integer
rounding: the interpreter's casts truncate). Quantized formats quantize the BF16 rounding of
``y`` with the math of ``kvplan.ops._store_kernels`` (bit-identical to ``store_kv_cache`` of
the same ``y``). ``EXACT`` (compiled GPU code) takes exp / cos / sin / rsqrt from libdevice,
the functions torch's CUDA kernels call; the interpreter has no libdevice.

State program: ``ring[store_rows[t]] = (kv[t], gate[t])`` in fp32, the gate biased as above
with ``BIAS``, for the kept rows only: ``store_rows[t]`` = the trash row (``ring_rows``, the
ring's last row) marks a row that is not kept, and its program writes nothing (a prompt keeps
a few rows per sequence of thousands: writing them all to one row cost ~0.1 ms a launch at
8K rows).
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from kvplan.ops._launch import jit
from kvplan.ops._quant_triton import bf16_bits, encode_e2m1_magnitude_raw, encode_e4m3
from kvplan.ops._store_kernels import _group_scales, _scaled

FMT_EXACT_F32 = 0  # fp32 bits
FMT_EXACT_BF16 = 1  # bf16 bits
FMT_QUANT = 2  # e4m3 / e2m1 values with group scales


@jit
def _rnd(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to the model dtype (RNE to BF16 when ``BF16``) and widened again."""
    if BF16:
        return (bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    return x


@jit
def _bias_row(pos, RATIO: tl.constexpr):
    """Row of the bias table of a step row at position ``pos``: ``pos mod RATIO`` (floor)."""
    p = pos.to(tl.int64)
    return ((p % RATIO) + RATIO) % RATIO


@jit
def _window_tile(
    src_ptr, ring_ptr, index_ptr, e, r0, cols, stride_src, ring_rows, fill, bias_ptr,
    step_pos_ptr, R: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
    OVERLAP: tl.constexpr, ROW_TILE: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    """fp32 ``[ROW_TILE, C]``: window rows ``r0 ..`` of entry ``e`` (``fill`` where empty;
    ``BIAS``: step rows plus their row of the fp32 ``[RATIO, K*C]`` table at ``bias_ptr``)."""
    rows = r0 + tl.arange(0, ROW_TILE)
    idx = tl.load(index_ptr + e * R + rows, mask=rows < R, other=-1).to(tl.int64)
    in_ring = (idx >= 0) & (idx < ring_rows)
    in_step = idx >= ring_rows
    if OVERLAP:
        half = tl.where(rows >= RATIO, C, 0)
    else:
        half = rows * 0
    col = half[:, None] + cols[None, :]
    ring_row = tl.where(in_ring, idx, 0)
    step_row = tl.where(in_step, idx - ring_rows, 0)
    kc: tl.constexpr = 2 * C if OVERLAP else C
    a = tl.load(ring_ptr + ring_row[:, None] * kc + col, mask=in_ring[:, None], other=0.0)
    b = tl.load(src_ptr + step_row[:, None] * stride_src + col, mask=in_step[:, None], other=0.0)
    b = b.to(tl.float32)
    if BIAS:
        brow = _bias_row(tl.load(step_pos_ptr + step_row, mask=in_step, other=0), RATIO)
        b += tl.load(bias_ptr + brow[:, None] * kc + col, mask=in_step[:, None], other=0.0)
    return tl.where(in_ring[:, None], a, tl.where(in_step[:, None], b, fill))


@jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    return tl.exp(x)


@jit
def _pool(
    kv_ptr, gate_ptr, kv_ring_ptr, gate_ring_ptr, index_ptr, bias_ptr, step_pos_ptr, e, cols,
    stride_kv, stride_gate, ring_rows, R: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
    OVERLAP: tl.constexpr, ROW_TILE: tl.constexpr, BF16: tl.constexpr, EXACT: tl.constexpr,
    BIAS: tl.constexpr,
):  # fmt: skip
    """fp32 ``[C]``: ``sum_i round(kv * round(softmax_i(gate)))`` of entry ``e``'s window."""
    neg_inf = float("-inf")
    m = tl.full([C], neg_inf, tl.float32)
    for r0 in tl.range(0, R, ROW_TILE):
        g = _window_tile(gate_ptr, gate_ring_ptr, index_ptr, e, r0, cols, stride_gate, ring_rows,
                         neg_inf, bias_ptr, step_pos_ptr, R, RATIO, C, OVERLAP, ROW_TILE,
                         BIAS)  # fmt: skip
        m = tl.maximum(m, tl.max(g, axis=0))
    m = tl.where(m == neg_inf, 0.0, m)  # (a window has at least one row; guards padding)
    s = tl.zeros([C], tl.float32)
    for r0 in tl.range(0, R, ROW_TILE):
        g = _window_tile(gate_ptr, gate_ring_ptr, index_ptr, e, r0, cols, stride_gate, ring_rows,
                         neg_inf, bias_ptr, step_pos_ptr, R, RATIO, C, OVERLAP, ROW_TILE,
                         BIAS)  # fmt: skip
        s += tl.sum(_exp(g - m[None, :], EXACT), axis=0)
    s = tl.where(s > 0, s, 1.0)
    acc = tl.zeros([C], tl.float32)
    for r0 in tl.range(0, R, ROW_TILE):
        g = _window_tile(gate_ptr, gate_ring_ptr, index_ptr, e, r0, cols, stride_gate, ring_rows,
                         neg_inf, bias_ptr, step_pos_ptr, R, RATIO, C, OVERLAP, ROW_TILE,
                         BIAS)  # fmt: skip
        kv = _window_tile(kv_ptr, kv_ring_ptr, index_ptr, e, r0, cols, stride_kv, ring_rows,
                          0.0, bias_ptr, step_pos_ptr, R, RATIO, C, OVERLAP, ROW_TILE,
                          False)  # fmt: skip
        p = _exp(g - m[None, :], EXACT)
        w = _rnd(tl.div_rn(p, tl.broadcast_to(s[None, :], p.shape)), BF16)
        acc += tl.sum(_rnd(kv * w, BF16), axis=0)
    return acc


@jit
def _norm_rope(x, cols, norm_ptr, inv_freq_ptr, pos, eps, rope_scale, C: tl.constexpr,
               NOPE_PAIRS: tl.constexpr, BF16: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    """RMSNorm (fp32, weight ``norm_ptr``) then the interleaved RoPE of the trailing pairs."""
    x = _rnd(x, BF16)
    ms = tl.sum(x * x, axis=0) / C
    if EXACT:
        inv = libdevice.rsqrt(ms + eps)
    else:
        inv = 1.0 / tl.sqrt_rn(ms + eps)
    y = _rnd(tl.load(norm_ptr + cols).to(tl.float32) * (x * inv), BF16)
    pairs = tl.reshape(y, [C // 2, 2])
    a, b = tl.split(pairs)  # channels 2i, 2i + 1
    p = tl.arange(0, C // 2)
    rot = p >= NOPE_PAIRS
    freq = tl.load(inv_freq_ptr + (p - NOPE_PAIRS), mask=rot, other=0.0).to(tl.float32)
    ang = pos.to(tl.float32) * freq
    if EXACT:
        cos, sin = libdevice.cos(ang), libdevice.sin(ang)
    else:
        cos, sin = tl.cos(ang), tl.sin(ang)
    cos = _rnd(cos * rope_scale, BF16)
    sin = _rnd(sin * rope_scale, BF16)
    a2 = _rnd(a * cos - b * sin, BF16)
    b2 = _rnd(b * cos + a * sin, BF16)
    a = tl.where(rot, a2, a)
    b = tl.where(rot, b2, b)
    return tl.reshape(tl.join(a, b), [C])


@jit
def _store_quant(y, dst, sdst, C: tl.constexpr, GS: tl.constexpr, G: tl.constexpr,
                 FP4: tl.constexpr, QMAX: tl.constexpr, SF: tl.constexpr, SB: tl.constexpr,
                 HW: tl.constexpr, FAST_DIV: tl.constexpr):  # fmt: skip
    """Quantize BF16-valued fp32 ``y [C]`` (``G`` groups of ``GS``) and write values at
    ``dst`` and scales at ``sdst`` (uint8 pointers), as ``store_quant_kernel`` does."""
    inf = float("inf")
    x = tl.reshape(y, [1, G, GS])
    finite = tl.abs(x) < inf
    xz = tl.where(finite, x, 0.0)  # inf and NaN count as +0 for the scale
    amax = tl.max(tl.abs(xz), axis=2)  # [1, G]
    factor, sbytes = _group_scales(amax, QMAX, SF, HW)
    if FP4:
        lo, hi = tl.split(tl.reshape(x, [1, G, GS // 2, 2]))
        lo_z, hi_z = tl.split(tl.reshape(xz, [1, G, GS // 2, 2]))
        q_lo = tl.where(tl.abs(lo) == inf, QMAX, _scaled(lo_z, factor, SF, FAST_DIV))
        q_hi = tl.where(tl.abs(hi) == inf, QMAX, _scaled(hi_z, factor, SF, FAST_DIV))
        s_lo = tl.where(lo != lo, 0, (lo.to(tl.int32, bitcast=True) >> 28) & 0x8)
        s_hi = tl.where(hi != hi, 0, (hi.to(tl.int32, bitcast=True) >> 24) & 0x80)
        raw = encode_e2m1_magnitude_raw(q_lo) | (encode_e2m1_magnitude_raw(q_hi) << 4)
        vbytes = ((raw & 0x77) | s_lo | s_hi).to(tl.uint8)
        tl.store(dst + tl.arange(0, C // 2), tl.reshape(vbytes, [C // 2]))
    else:
        q = _scaled(xz, factor, SF, FAST_DIV)
        q = tl.where(tl.abs(x) == inf, tl.where(x > 0, QMAX, -QMAX), q)
        if HW:
            if SF != 0:
                q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            vbytes = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            vbytes = encode_e4m3(q).to(tl.uint8)
        tl.store(dst + tl.arange(0, C), tl.reshape(vbytes, [C]))
    tl.store(sdst + tl.arange(0, G * SB), tl.reshape(sbytes, [G * SB]).to(tl.uint8))


@jit
def compress_store_kernel(
    kv_ptr,  # [T, K*C] model dtype, row stride stride_kv
    gate_ptr,  # [T, K*C] fp32 (BIAS: fp32 / BF16, unbiased), row stride stride_gate
    kv_ring_ptr,  # fp32 [ring_rows + 1, K*C] contiguous
    gate_ring_ptr,  # fp32 [ring_rows + 1, K*C] contiguous
    index_ptr,  # int32 / int64 [E, R] contiguous, [ring | step] space, -1 empty
    pos_ptr,  # int64 [E]
    slot_ptr,  # int32 [E]
    store_rows_ptr,  # int64 [T]
    norm_ptr,  # fp32 [C]
    inv_freq_ptr,  # fp32 [RD / 2]
    cache_ptr,  # uint8, block 0 of the cache
    pooled_ptr,  # fp32 [E, C] (WRITE_POOLED only)
    bias_ptr,  # fp32 [RATIO, K*C] contiguous (BIAS only)
    step_pos_ptr,  # int64 / int32 [T] (BIAS only)
    num_entries,
    num_state_rows,
    ring_rows,
    stride_kv,
    stride_gate,
    eps,
    rope_scale,
    num_slots,
    block_stride,
    v_stride,
    s_block_off,
    s_stride,
    BLOCK_SIZE: tl.constexpr,
    C: tl.constexpr,  # entry width (power of two)
    R: tl.constexpr,  # window rows (r, or 2r with OVERLAP)
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_TILE: tl.constexpr,
    NOPE_PAIRS: tl.constexpr,  # (C - RD) / 2: pairs left unrotated
    BF16: tl.constexpr,  # model dtype BF16 (else fp32)
    FMT: tl.constexpr,  # FMT_EXACT_F32 / FMT_EXACT_BF16 / FMT_QUANT
    GS: tl.constexpr,
    G: tl.constexpr,
    FP4: tl.constexpr,
    QMAX: tl.constexpr,
    SF: tl.constexpr,
    SB: tl.constexpr,
    HW: tl.constexpr,
    FAST_DIV: tl.constexpr,
    EXACT: tl.constexpr,
    WRITE_POOLED: tl.constexpr,
    BIAS: tl.constexpr,  # add the bias table's row pos[t] mod RATIO to step row t's gate
):
    pid = tl.program_id(0)
    kc: tl.constexpr = 2 * C if OVERLAP else C
    if pid < num_entries:
        e = pid.to(tl.int64)
        slot = tl.load(slot_ptr + e)
        ok = (slot >= 0) & (slot < num_slots)
        go = ok
        if WRITE_POOLED:
            go = slot == slot  # every entry (tests)
        if go:
            cols = tl.arange(0, C)
            x = _pool(kv_ptr, gate_ptr, kv_ring_ptr, gate_ring_ptr, index_ptr, bias_ptr,
                      step_pos_ptr, e, cols, stride_kv, stride_gate, ring_rows, R, RATIO, C,
                      OVERLAP, ROW_TILE, BF16, EXACT, BIAS)  # fmt: skip
            pos = tl.load(pos_ptr + e)
            y = _norm_rope(x, cols, norm_ptr, inv_freq_ptr, pos, eps, rope_scale, C, NOPE_PAIRS,
                           BF16, EXACT)  # fmt: skip
            if WRITE_POOLED:
                tl.store(pooled_ptr + e * C + cols, y)
            if ok:
                s64 = tl.where(ok, slot, 0).to(tl.int64)
                block, offset = s64 // BLOCK_SIZE, s64 % BLOCK_SIZE
                dst = cache_ptr + block * block_stride + offset * v_stride
                if FMT == 0:
                    bits = y.to(tl.int32, bitcast=True)
                    k = tl.arange(0, 4)
                    out = (bits[:, None] >> (8 * k)[None, :]) & 255
                    tl.store(dst + tl.arange(0, 4 * C), tl.reshape(out, [4 * C]).to(tl.uint8))
                elif FMT == 1:
                    bits = bf16_bits(y)
                    k = tl.arange(0, 2)
                    out = (bits[:, None] >> (8 * k)[None, :]) & 255
                    tl.store(dst + tl.arange(0, 2 * C), tl.reshape(out, [2 * C]).to(tl.uint8))
                else:
                    sdst = cache_ptr + block * block_stride + s_block_off + offset * s_stride
                    _store_quant(_rnd(y, True), dst, sdst, C, GS, G, FP4, QMAX, SF, SB, HW,
                                 FAST_DIV)  # fmt: skip
    else:
        t = (pid - num_entries).to(tl.int64)
        dst = tl.load(store_rows_ptr + t, mask=t < num_state_rows, other=ring_rows)
        if dst < ring_rows:  # a kept row (the rest would all go to the trash row: skipped)
            c = tl.arange(0, kc)
            kv = tl.load(kv_ptr + t * stride_kv + c).to(tl.float32)
            tl.store(kv_ring_ptr + dst * kc + c, kv)
            g = tl.load(gate_ptr + t * stride_gate + c).to(tl.float32)
            if BIAS:
                g += tl.load(bias_ptr + _bias_row(tl.load(step_pos_ptr + t), RATIO) * kc + c)
            tl.store(gate_ring_ptr + dst * kc + c, g)
