"""Triton kernels of the model's small ops (launched by `kvplan.models.fused`).

Each kernel repeats the torch path's rounding steps: values are widened to fp32, every
intermediate that torch materializes in the model dtype is rounded back to it with
``.to(dtype).to(tl.float32)``, and launches pass ``enable_fp_fusion=False`` so that an fp32
``a * b + c`` is not contracted into an FMA the torch path does not use.

- ``rms_norm_kernel``: grid ``(T,)``; one row of ``[T, N]`` per program (``TILE_N >= N``),
  optionally adding ``residual`` first and writing the sum back into it.
- ``qkv_epilogue_kernel``: grid ``(T, cdiv(H + 2 Hkv, TILE_H))``; a tile holds ``TILE_H``
  consecutive heads of one token's ``qkv`` row (q heads, then k heads, then v heads); q and k
  rows get the optional per-head RMSNorm and RoPE, v rows are copied; each row is stored into
  its own contiguous output (q, k or v).
- ``silu_and_mul_kernel``: grid ``(T, cdiv(I, TILE))``.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from kvplan.ops._launch import jit
from kvplan.ops._quant_triton import bf16_bits, encode_e4m3, encode_int8
from kvplan.ops._store_kernels import INF_BITS, _scaled, _scales_of, e2m1_record
from kvplan.ops._triton_util import round_to as _round


@jit
def sum_parts(ptrs, mask, stride_part, PARTS: tl.constexpr, dtype: tl.constexpr):
    """The fp32 partials at ``ptrs`` and ``PARTS - 1`` further ``stride_part`` elements apart
    (`kvplan.models.fused.SplitSums`), summed in order from the first and rounded to
    ``dtype`` (widened to fp32 again); masked elements 0."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, PARTS):
        x += tl.load(ptrs + s * stride_part, mask=mask, other=0.0)
    return _round(x, dtype)


@jit
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_res, inv_n, eps, stride_part,
    HAS_RESIDUAL: tl.constexpr, TILE_N: tl.constexpr, PARTS: tl.constexpr = 0,
):  # fmt: skip
    """``out[t] = w * round(h * rsqrt(mean(h^2) + eps))``, ``h = round(x[t] (+ res[t]))``.

    ``PARTS > 0``: ``x`` is ``PARTS`` fp32 partial sums ``stride_part`` elements apart, and
    ``x[t]`` is their sum (in order, from the first) rounded to the output dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILE_N)
    mask = cols < n_cols
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if PARTS > 0:
        x = sum_parts(x_ptr + row * stride_x + cols, mask, stride_part, PARTS, dtype)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_row = res_ptr + row * stride_res + cols
        h = x + tl.load(res_row, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_row, h.to(dtype), mask=mask)  # the new residual stream
        h = _round(h, dtype)
    else:
        h = x
    # torch's CUDA mean multiplies the sum by 1/N (inv_n, an fp32 argument)
    rrms = tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * _round(h * rrms, dtype)).to(dtype), mask=mask)


@jit
def _head_norm(x, w, eps, inv_d, dtype: tl.constexpr):
    """Per-row RMSNorm of ``x [TILE_H, TILE_D]`` (fp32, padding columns 0) with ``w``."""
    rrms = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
    return _round(w * _round(x * rrms[:, None], dtype), dtype)


@jit
def qkv_epilogue_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
    stride_qkv, num_positions, eps, inv_d,
    slot_ptr, kc_ptr, vc_ptr, num_slots, stride_cb, stride_ct, s_off, s_stride, stride_part,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr, TILE_H: tl.constexpr, TILE_D: tl.constexpr,
    STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr = 0,
    GS: tl.constexpr = 1, QMAX: tl.constexpr = 1.0, SF: tl.constexpr = 2, SB: tl.constexpr = 4,
    HW: tl.constexpr = True, FAST_DIV: tl.constexpr = False, SEARCH: tl.constexpr = False,
    PARTS: tl.constexpr = 0,
):  # fmt: skip
    """Split one token's ``qkv`` heads into q/k/v, norming (optional) and rotating q and k.
    (``PARTS > 0``: ``qkv`` is that many fp32 partials ``stride_part`` apart, `sum_parts`.)

    RoPE (rotate_half convention), with ``x'`` = x rotated by half the head::

        out[d] = round(round(x[d] * cos[d]) + round(sign(d) * x'[d] * sin[d]))
        x'[d] = x[(d + D/2) % D],  sign(d) = -1 for d < D/2 else +1

    A position outside ``[0, num_positions)`` makes that token's q and k rows NaN instead of
    reading outside the cos/sin tables.

    ``STORE``: also write the token's k and v rows (as stored in k / v, then cast to the cache
    dtype) into the paged caches ``kc`` / ``vc`` ``[blocks, BLOCK_SIZE, NUM_KV_HEADS,
    HEAD_DIM]`` (strides ``stride_cb`` / ``stride_ct`` per block / token, heads contiguous) at
    slot ``slot[t]``; a slot outside ``[0, num_slots)`` (-1: padding) writes nothing.
    ``QUANT`` 1 (e4m3) / 2 (e2m1) / 3 (int8): ``kc`` / ``vc`` are the uint8 token records of a
    quantized cache (strides in bytes; a head's values at ``head * HEAD_DIM`` (e2m1: ``/ 2``), its ``HEAD_DIM / GS``
    scales of ``SB`` bytes at ``s_off + head * HEAD_DIM / GS * SB``, ``s_stride`` per token),
    written as ``store_kv_cache`` writes the bf16-rounded rows (`_store_quantized`).
    """
    t = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)  # [TILE_H]
    d = tl.arange(0, TILE_D)
    d_rot = tl.where(d < HALF, d + HALF, d - HALF)
    d_ok = d < HEAD_DIM
    is_q = heads < NUM_HEADS
    is_k = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_HEADS + NUM_KV_HEADS) & (heads < NUM_HEADS + 2 * NUM_KV_HEADS)
    mask = (is_q | is_k | is_v)[:, None] & d_ok[None, :]
    row = qkv_ptr + t * stride_qkv + heads[:, None] * HEAD_DIM  # [TILE_H, 1]
    if PARTS > 0:
        x = sum_parts(row + d[None, :], mask, stride_part, PARTS, dtype)
        x_rot = sum_parts(row + d_rot[None, :], mask, stride_part, PARTS, dtype)
    else:
        x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x_rot = tl.load(row + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        w_q = tl.load(qw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w_k = tl.load(kw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.where(is_q[:, None], w_q[None, :], w_k[None, :])
        w_q_rot = tl.load(qw_ptr + d_rot, mask=d_ok, other=0.0).to(tl.float32)
        w_k_rot = tl.load(kw_ptr + d_rot, mask=d_ok, other=0.0).to(tl.float32)
        w_rot = tl.where(is_q[:, None], w_q_rot[None, :], w_k_rot[None, :])
        x_qk = _head_norm(x, w, eps, inv_d, dtype)
        x_rot = _head_norm(x_rot, w_rot, eps, inv_d, dtype)  # the same rows: same rms
    else:
        x_qk = x
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < num_positions)
    trig = tl.where(pos_ok, pos, 0) * HEAD_DIM + d
    cos = tl.load(cos_ptr + trig, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + trig, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.where(d < HALF, -sin, sin)  # rotate_half's sign, exact
    y = _round(x_qk * cos[None, :], dtype) + _round(x_rot * sin[None, :], dtype)
    y = tl.where(pos_ok, y, float("nan"))
    q_off = t * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(q_ptr + q_off, y.to(dtype), mask=mask & is_q[:, None])
    kv_off = t * (NUM_KV_HEADS * HEAD_DIM) + (heads[:, None] - NUM_HEADS) * HEAD_DIM + d[None, :]
    tl.store(k_ptr + kv_off, y.to(dtype), mask=mask & is_k[:, None])
    v_off = kv_off - NUM_KV_HEADS * HEAD_DIM
    tl.store(v_ptr + v_off, x.to(dtype), mask=mask & is_v[:, None])
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        slot_ok = (slot >= 0) & (slot < num_slots)
        slot = tl.where(slot_ok, slot, 0)
        block = slot // BLOCK_SIZE
        rec = block * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        kv_head = tl.where(is_k, heads - NUM_HEADS, heads - NUM_HEADS - NUM_KV_HEADS)
        if QUANT == 0:
            c_off = rec + kv_head[:, None] * HEAD_DIM + d[None, :]
            keep = mask & slot_ok
            _store_cast(kc_ptr + c_off, y.to(dtype), keep & is_k[:, None])
            _store_cast(vc_ptr + c_off, x.to(dtype), keep & is_v[:, None])
        else:
            sbase = block * stride_cb + s_off + (slot % BLOCK_SIZE) * s_stride
            # (uniform branches: a program whose tile holds no K / V head skips that quantizer)
            if tl.max(is_k.to(tl.int32), axis=0) > 0:
                _store_quantized(kc_ptr, rec, sbase, kv_head, y.to(dtype), is_k & slot_ok,
                                 TILE_H, HEAD_DIM, QUANT, GS, QMAX, SF, SB, HW, FAST_DIV,
                                 SEARCH)  # fmt: skip
            if tl.max(is_v.to(tl.int32), axis=0) > 0:
                _store_quantized(vc_ptr, rec, sbase, kv_head, x.to(dtype), is_v & slot_ok,
                                 TILE_H, HEAD_DIM, QUANT, GS, QMAX, SF, SB, HW, FAST_DIV,
                                 SEARCH)  # fmt: skip


@jit
def _store_quantized(
    c_ptr, vbase, sbase, kv_head, val, rows, TILE_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr, GS: tl.constexpr, QMAX: tl.constexpr, SF: tl.constexpr,
    SB: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """Quantize the heads ``kv_head`` (rows where ``rows``) of ``val`` ``[TILE_H, HEAD_DIM]``
    into a token record: the values rounded to bf16 first (``KVCacheTensors.store`` casts its
    input so), one scale per ``GS`` values, then the rules of ``store_quant_kernel`` (the same
    jit helpers; e2m1 (``QUANT`` 2): its `e2m1_record` on the bf16 pairs), non-finite inputs
    included: its branch taken for every group, which for finite groups gives its finite
    path's bits."""
    G: tl.constexpr = HEAD_DIM // GS
    VB: tl.constexpr = HEAD_DIM // 2 if QUANT == 2 else HEAD_DIM  # value bytes of a head
    w = val.to(tl.float32)
    if val.dtype != tl.bfloat16:  # RNE to bf16 by bits (the interpreter's cast truncates)
        w = tl.where(w == w, (bf16_bits(w) << 16).to(tl.float32, bitcast=True), w)
    if QUANT == 2:  # two values a byte: element 2i in a word's low half, 2i + 1 in its high
        bits = tl.where(w == w, (w.to(tl.int32, bitcast=True) >> 16) & 0xFFFF, 0x7FC0)
        even, odd = tl.split(tl.reshape(bits, [TILE_H, VB, 2]))
        words = tl.reshape(even | (odd << 16), [TILE_H, G, GS // 2])
        vbytes, sbytes = e2m1_record(words, rows, QMAX, SF, SEARCH, HW, FAST_DIV)
    else:
        x = tl.reshape(w, [TILE_H, G, GS])
        xb = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| bits: inf = INF_BITS, NaN above
        finite = xb < INF_BITS
        amax_b = tl.max(tl.where(finite, xb, 0), axis=2)  # [TILE_H, G]
        xz = tl.where(finite, x, 0.0)
        amax = amax_b.to(tl.float32, bitcast=True)
        factor, sbytes = _scales_of(xz, amax, QMAX, SF, SEARCH, HW, FAST_DIV)
        q = _scaled(xz, factor, SF, FAST_DIV)
        q = tl.where(xb == INF_BITS, tl.where(x > 0, QMAX, -QMAX), q)  # +-inf -> +-QMAX, NaN -> 0
        if QUANT == 3:
            vbytes = (encode_int8(q) & 255).to(tl.uint8)
        elif HW:
            if SF != 0:
                q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
            vbytes = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            vbytes = encode_e4m3(q).to(tl.uint8)
    d = tl.arange(0, VB)
    ok = rows[:, None]
    v_off = vbase + kv_head[:, None] * VB + d[None, :]
    tl.store(c_ptr + v_off, tl.reshape(vbytes, [TILE_H, VB]), mask=ok)
    j = tl.arange(0, G * SB)
    s_off = sbase + kv_head[:, None] * (G * SB) + j[None, :]
    tl.store(c_ptr + s_off, tl.reshape(sbytes, [TILE_H, G * SB]).to(tl.uint8), mask=ok)


@jit
def _store_cast(ptrs, val, mask):
    """Store ``val`` cast to the pointers' float dtype, rounding to nearest even as torch's
    ``.to`` does: a wider value going into bf16 is rounded by its bits (the interpreter's
    fp32 -> bf16 cast truncates), NaN as torch's canonical 0x7FC0."""
    c_dtype: tl.constexpr = ptrs.dtype.element_ty
    if c_dtype == tl.bfloat16 and val.dtype != tl.bfloat16:
        wide = val.to(tl.float32)
        bits = tl.where(wide == wide, bf16_bits(wide), 0x7FC0)
        tl.store(ptrs.to(tl.pointer_type(tl.int16)), bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, val.to(c_dtype), mask=mask)


@jit
def silu_and_mul_kernel(
    gu_ptr, out_ptr, inter, stride_gu, TILE: tl.constexpr, EXACT: tl.constexpr
):  # fmt: skip
    """``out[t, j] = round(round(silu(gate)) * up)``, gate = ``gu[t, j]``, up = ``gu[t, I + j]``.

    ``EXACT`` (compiled GPU code) uses libdevice ``expf`` and IEEE division, the operations
    of torch's CUDA ``silu`` (``x / (1 + exp(-x))`` in fp32); the interpreter has no libdevice.
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = cols < inter
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    row = gu_ptr + t * stride_gu + cols
    gate = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter, mask=mask, other=0.0).to(tl.float32)
    if EXACT:
        silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t * inter + cols, (_round(silu, dtype) * up).to(dtype), mask=mask)
