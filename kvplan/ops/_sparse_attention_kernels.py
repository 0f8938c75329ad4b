"""Triton kernel of ``kvplan.ops.sparse_attention``: attention with per-head sinks over index
tables into one or two key sources, dequantizing quantized caches in registers.

Grid ``(T, cdiv(H, TILE_H))``: program ``(t, g)`` owns query row ``t`` and heads
``g * TILE_H + [0, TILE_H)``; the rows of its tiles are heads, so every key tile is loaded once
for the whole head tile. For each source it walks the row's index columns in tiles of
``TILE_N``; column ``k`` names slot ``s = index[t, k]`` (``-1``: not visible), i.e. row
``s % block_size`` of block ``s // block_size``::

    address of element d of slot s = ptr + (s // block_size) * stride_block
                                         + (s % block_size) * stride_token + d
    quantized (token-interleaved record): value byte(s) at that address (e2m1: d // 2),
    scale of group d // GS at  ... + scale_offset + (d // GS) * SB

Block sizes are constexprs (one specialization per cache geometry): the slot's split into
block and row then compiles to shifts and masks, where a runtime int64 division called a
software routine for every key row (the sm_90 code of ``index_scores_tc_kernel`` held 17 such
calls a 128-key tile, the attention kernel 20).

Source kinds (``KIND``): 0 fp32 rows, 1 bf16 rows, 2 e4m3 values, 3 e2m1 values (low nibble =
even element); quantized scales (``SF``): 0 UE8M0 exponent byte, 1 e4m3 byte, 2 fp32 (4
bytes); split (index) layouts put a block's scales after its values (``scale_stride`` /
``scale_offset``). A dequantized key is ``bf16(value * scale)`` as ``load_paged_kv_cache``
gives it (only fp32 scales need the rounding; the other products are exact in bf16).

``index_scores_tc_kernel`` is the lightning indexer's scoring over the same addressing: one
query row's ``Hi`` heads against ``TILES`` tiles of ``TILE_N`` keys per program, the keys as
the rows of one dot (bf16 queries on the tensor cores); ``index_scores_kernel`` is the
earlier CUDA-core form (fp32 products, ``TILE_N`` keys per program), kept for comparison.

Softmax runs online in the log2 domain and starts from the sink: ``m = sink * log2(e)``,
``l = 1``, so the sink's term is in the denominator and a row that sees no key ends with
``acc = 0``. Products: with ``DOT_BF16`` the query and the dequantized keys enter ``tl.dot``
as bf16 (exact for e4m3 / e2m1 values times power-of-two or e4m3 scales) and the
probabilities are rounded to bf16 for the value product; otherwise fp32 with ``"ieee"``
precision. The CPU interpreter takes the same bf16 path (``kvplan.ops._interpreter_bf16``
fixes its bf16 ``tl.dot``).

``HALF_RD > 0`` (``out_rope``): the epilogue rounds each output row to out's dtype and turns
its trailing ``2 * HALF_RD`` channels back by the row's rotary angle (``_store_out``): the
bits ``kvplan.ops.rope.norm_rope(out, cos, sin, inverse=True)`` gives, without its pass over
the output.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from kvplan.ops._launch import jit
from kvplan.ops._paged_kv_tiles import e2m1_f16_tile, nibble_acc, nibble_query, query_f16
from kvplan.ops._quant_triton import bf16_bits, decode_e2m1, decode_e4m3

KIND_FP32 = 0
KIND_BF16 = 1
KIND_E4M3 = 2
KIND_E2M1 = 3
NIB: tl.constexpr = tl.constexpr(2)  # ``F16`` of fp16 tiles in nibble order
SF_UE8M0 = 0
SF_E4M3 = 1
SF_FP32 = 2
LOG2E = tl.constexpr(1.4426950408889634)  # a jit-visible global must be a constexpr


@jit
def _scale_mult(sb, SF: tl.constexpr):
    """int32 scale bytes -> fp32 multipliers (UE8M0: 2^(b - 127); e4m3: its value)."""
    if SF == 0:
        return (sb << 23).to(tl.float32, bitcast=True)
    else:
        return decode_e4m3(sb)


@jit
def _scales_at(c_ptr, sbase, grp, mask, SF: tl.constexpr):
    """fp32 multipliers of scale group ``grp`` of the records whose scales start at byte
    ``sbase`` (fp32 scales: 4 bytes, little-endian, assembled from single bytes since a
    record need not be 4-aligned)."""
    if SF == 2:
        addr = sbase + grp * 4
        b0 = tl.load(c_ptr + addr, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(c_ptr + addr + 1, mask=mask, other=0).to(tl.int32)
        b2 = tl.load(c_ptr + addr + 2, mask=mask, other=0).to(tl.int32)
        b3 = tl.load(c_ptr + addr + 3, mask=mask, other=0).to(tl.int32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
    else:
        return _scale_mult(tl.load(c_ptr + sbase + grp, mask=mask, other=0).to(tl.int32), SF)


@jit
def _load_key_cols(
    c_ptr, slots, valid, d0, block_size, stride_block, stride_token, scale_stride, scale_offset,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    DW: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr, HW: tl.constexpr,
    BF16: tl.constexpr, F16: tl.constexpr = False,
):  # fmt: skip
    """Columns ``[d0, d0 + DW)`` of the rows of ``slots``: ``[TILE_N, DW]``, zeros where not
    ``valid`` or ``d >= D``; fp32, or bf16 with ``BF16`` (the same values: every dequantized
    key is a bf16; an fp32 source row is rounded). ``FLAT``: ``d0`` and ``DW`` are
    multiples of ``GS`` (``DW // GS`` a power of two) and ``d0 + DW <= HEAD_DIM``. Scales of
    slot ``s`` start at ``block * stride_block + row * scale_stride + scale_offset``
    (token-interleaved records: ``scale_stride = stride_token``). ``F16`` (e2m1 values with
    e4m3 scales, ``FLAT``, value runs 4-byte aligned): the values in fp16, read as int32
    words and scaled in fp16 (`e2m1_f16_tile`: the same, exact values); ``F16`` 2 (``NIB``):
    times 2^-14, the columns in nibble order (its ``TINY``)."""
    s = tl.where(valid, slots, 0).to(tl.int64)
    blk, off = s // block_size, s % block_size
    base = blk * stride_block + off * stride_token  # [TILE_N]
    sbase = blk * stride_block + off * scale_stride + scale_offset
    d = d0 + tl.arange(0, DW)
    dmask = valid[:, None] & (d < HEAD_DIM)[None, :]
    if F16:
        tl.static_assert(KIND == 3 and SF == 1 and FLAT, "F16 tiles: e2m1 with e4m3 scales")
        words = (c_ptr + base[:, None] + d0 // 2).to(tl.pointer_type(tl.int32))
        w = tl.load(words + tl.arange(0, DW // 8)[None, :], mask=valid[:, None], other=0)
        sb = tl.load(c_ptr + sbase[:, None] + (d0 // GS + tl.arange(0, DW // GS))[None, :],
                     mask=valid[:, None], other=0)  # fmt: skip
        x = e2m1_f16_tile(w, sb, TILE_N, DW, GS, F16 == NIB)
    elif KIND == 0:
        x = tl.load(c_ptr + base[:, None] + d[None, :], mask=dmask, other=0.0)
        if BF16:
            x = x.to(tl.bfloat16)
    elif KIND == 1:
        x = tl.load(c_ptr + base[:, None] + d[None, :], mask=dmask, other=0.0)
        if not BF16:
            x = x.to(tl.float32)
    else:
        if KIND == 2:
            vb = tl.load(c_ptr + base[:, None] + d[None, :], mask=dmask, other=0)
            if HW:
                vals = vb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                vals = decode_e4m3(vb.to(tl.int32))
        else:
            vb = tl.load(c_ptr + base[:, None] + (d // 2)[None, :], mask=dmask, other=0)
            codes = (vb.to(tl.int32) >> ((d & 1) * 4)[None, :]) & 15
            vals = decode_e2m1(codes)
        if FLAT:
            G: tl.constexpr = DW // GS
            g = d0 // GS + tl.arange(0, G)
            mult = _scales_at(c_ptr, sbase[:, None], g[None, :], valid[:, None], SF)
            x = tl.reshape(tl.reshape(vals, [TILE_N, G, GS]) * mult[:, :, None], [TILE_N, DW])
        else:
            x = vals * _scales_at(c_ptr, sbase[:, None], (d // GS)[None, :], dmask, SF)
        if SF == 2:  # value * fp32 scale is not always a bf16: round it as a cast load does
            x = (bf16_bits(x) << 16).to(tl.float32, bitcast=True)
        if BF16:  # exact: every dequantized key is a bf16
            x = x.to(tl.bfloat16)
    return x


@jit
def _load_keys(
    c_ptr, slots, valid, block_size, stride_block, stride_token, scale_stride, scale_offset,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """fp32 ``[TILE_N, D_P2]`` rows of ``slots`` (``_load_key_cols`` over all columns)."""
    return _load_key_cols(c_ptr, slots, valid, 0, block_size, stride_block, stride_token,
                          scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N,
                          FLAT, HW, False)  # fmt: skip


@jit
def _attend_tile(
    acc, m_i, l_i, q, q_row, h_ok, start, row_idx, num_cols, num_slots, c_ptr,
    block_size, stride_block, stride_token, scale_stride, scale_offset, qk_scale,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr,
    HW: tl.constexpr, DOT_BF16: tl.constexpr, D_CHUNK: tl.constexpr, PV_SPLIT: tl.constexpr,
    F16: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over index columns ``[start, start + TILE_N)``. ``D_CHUNK``
    0: ``q`` is the whole query tile; else the logits are summed over ``D_CHUNK``-column
    chunks of the query (re-read through ``q_row``, ``[TILE_H, 1]`` pointers, each tile) and
    of the keys, and ``q`` is unused. ``F16`` (``D_CHUNK`` 0): fp16 query, key tiles
    (`_load_key_cols`) and probabilities."""
    tl.static_assert(not F16 or D_CHUNK == 0, "F16 tiles need the whole query (D_CHUNK 0)")
    cols = start + tl.arange(0, TILE_N)
    slots = tl.load(row_idx + cols, mask=cols < num_cols, other=-1)
    valid = (slots >= 0) & (slots < num_slots)
    if D_CHUNK == 0:
        kd = _load_key_cols(c_ptr, slots, valid, 0, block_size, stride_block, stride_token,
                            scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N,
                            FLAT, HW, DOT_BF16, F16)  # fmt: skip
        if DOT_BF16:
            s = tl.dot(q, tl.trans(kd))
        else:
            s = tl.dot(q, tl.trans(kd), input_precision="ieee")
    else:
        FLAT_C: tl.constexpr = FLAT and D_CHUNK >= GS
        live = start < num_cols  # keeps the query loads in the loop
        s = tl.zeros([TILE_H, TILE_N], tl.float32)
        for c in range(0, D_P2 // D_CHUNK):
            dq = c * D_CHUNK + tl.arange(0, D_CHUNK)
            qmask = h_ok[:, None] & (dq < HEAD_DIM)[None, :] & live
            qc = tl.load(q_row + dq[None, :], mask=qmask, other=0.0)
            kc = _load_key_cols(c_ptr, slots, valid, c * D_CHUNK, block_size, stride_block,
                                stride_token, scale_stride, scale_offset, KIND, SF, GS,
                                HEAD_DIM, D_CHUNK, TILE_N, FLAT_C, HW, DOT_BF16)  # fmt: skip
            if DOT_BF16:
                s = tl.dot(qc.to(tl.bfloat16), tl.trans(kc), s)
            else:
                s = tl.dot(qc.to(tl.float32), tl.trans(kc), s, input_precision="ieee")
        kd = 0.0
        if PV_SPLIT == 1:
            kd = _load_key_cols(c_ptr, slots, valid, 0, block_size, stride_block,
                                stride_token, scale_stride, scale_offset, KIND, SF, GS,
                                HEAD_DIM, D_P2, TILE_N, FLAT, HW, DOT_BF16)  # fmt: skip
    p, alpha, m_new, l_i = softmax_step(s, valid[None, :], m_i, l_i, qk_scale)
    if F16:
        p = p.to(tl.float16)
    elif DOT_BF16:
        p = p.to(tl.bfloat16)
    if PV_SPLIT == 1:
        acc = (_pv_step(acc[0], alpha, p, kd, DOT_BF16),)
    else:
        acc = _pv_split(acc, alpha, p, c_ptr, slots, valid, block_size, stride_block,
                        stride_token, scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM,
                        D_P2, TILE_N, FLAT, HW, DOT_BF16, PV_SPLIT, F16)  # fmt: skip
    return acc, m_new, l_i


@jit
def softmax_step(s, seen, m_i, l_i, qk_scale):
    """One online-softmax step in the log2 domain: the logits ``s * qk_scale`` where
    ``seen`` (else ``-inf``) against the running maximum ``m_i`` and sum ``l_i`` of each
    row; returns the probabilities, the old state's factor ``alpha``, the new maximum and
    sum."""
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@jit
def _pv_step(acc, alpha, p, v, DOT_BF16: tl.constexpr):
    """``acc * alpha + p @ v`` (``p`` already bf16 for bf16 dots)."""
    if DOT_BF16:
        pv = tl.dot(p, v)
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    return acc * alpha[:, None] + pv


@jit
def _pv_split(
    acc, alpha, p, c_ptr, slots, valid, block_size, stride_block, stride_token, scale_stride,
    scale_offset, KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr,
    HW: tl.constexpr, DOT_BF16: tl.constexpr, PV_SPLIT: tl.constexpr, F16: tl.constexpr,
):  # fmt: skip
    """The value product on ``PV_SPLIT`` (2 or 4) column chunks of the accumulator (a tuple),
    each chunk's values re-read: the same products, a smaller live value tile."""
    DC: tl.constexpr = D_P2 // PV_SPLIT
    FLAT_C: tl.constexpr = FLAT and DC >= GS
    v0 = _load_key_cols(c_ptr, slots, valid, 0, block_size, stride_block, stride_token,
                        scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, DC, TILE_N, FLAT_C,
                        HW, DOT_BF16, F16)  # fmt: skip
    a0 = _pv_step(acc[0], alpha, p, v0, DOT_BF16)
    v1 = _load_key_cols(c_ptr, slots, valid, DC, block_size, stride_block, stride_token,
                        scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, DC, TILE_N, FLAT_C,
                        HW, DOT_BF16, F16)  # fmt: skip
    a1 = _pv_step(acc[1], alpha, p, v1, DOT_BF16)
    if PV_SPLIT == 2:
        return a0, a1
    else:
        v2 = _load_key_cols(c_ptr, slots, valid, 2 * DC, block_size, stride_block,
                            stride_token, scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM,
                            DC, TILE_N, FLAT_C, HW, DOT_BF16, F16)  # fmt: skip
        a2 = _pv_step(acc[2], alpha, p, v2, DOT_BF16)
        v3 = _load_key_cols(c_ptr, slots, valid, 3 * DC, block_size, stride_block,
                            stride_token, scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM,
                            DC, TILE_N, FLAT_C, HW, DOT_BF16, F16)  # fmt: skip
        a3 = _pv_step(acc[3], alpha, p, v3, DOT_BF16)
        return a0, a1, a2, a3


@jit
def _acc_zeros(TILE_H: tl.constexpr, D_P2: tl.constexpr, PV_SPLIT: tl.constexpr):
    """The accumulator: a tuple of ``PV_SPLIT`` fp32 ``[TILE_H, D_P2 // PV_SPLIT]`` zeros."""
    DC: tl.constexpr = D_P2 // PV_SPLIT
    if PV_SPLIT == 1:
        return (tl.zeros([TILE_H, DC], tl.float32),)
    elif PV_SPLIT == 2:
        return tl.zeros([TILE_H, DC], tl.float32), tl.zeros([TILE_H, DC], tl.float32)
    else:
        z = tl.zeros([TILE_H, DC], tl.float32)
        return z, z, z, z


@jit
def _attend_cols(
    acc, m_i, l_i, q, q_row, h_ok, t, lo, hi, c_ptr, idx_ptr, stride_idx, num_slots,
    block_size, stride_block, stride_token, scale_stride, scale_offset, qk_scale,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr,
    HW: tl.constexpr, DOT_BF16: tl.constexpr, D_CHUNK: tl.constexpr, PV_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr, F16: tl.constexpr,
):  # fmt: skip
    """Online-softmax steps over index columns ``[lo, hi)`` of row ``t`` of one source (the
    whole row: ``lo = 0``, ``hi = num_cols``; a split: its share). The CPU interpreter cannot
    take a runtime bound in ``range``: there a ``while`` loop runs the same steps."""
    row_idx = idx_ptr + t.to(tl.int64) * stride_idx
    if INTERPRET:
        start = lo
        while start < hi:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_row, h_ok, start, row_idx, hi, num_slots, c_ptr,
                block_size, stride_block, stride_token, scale_stride, scale_offset, qk_scale,
                KIND, SF, GS, HEAD_DIM, D_P2, TILE_H, TILE_N, FLAT, HW, DOT_BF16, D_CHUNK,
                PV_SPLIT, F16,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(lo, hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_row, h_ok, start, row_idx, hi, num_slots, c_ptr,
                block_size, stride_block, stride_token, scale_stride, scale_offset, qk_scale,
                KIND, SF, GS, HEAD_DIM, D_P2, TILE_H, TILE_N, FLAT, HW, DOT_BF16, D_CHUNK,
                PV_SPLIT, F16,
            )  # fmt: skip
    return acc, m_i, l_i


@jit
def acc_chunk(acc, F16: tl.constexpr):
    """An accumulator chunk in order at its true size (``F16`` 2, ``NIB``: from nibble order,
    times 2^14 -- exact)."""
    if F16 == NIB:
        return nibble_acc(acc)
    return acc


@jit
def _load_query(q_ptr, t, h64, h_ok, d, stride_qt, stride_qh, qk_scale,
                HEAD_DIM: tl.constexpr, DOT_BF16: tl.constexpr, D_CHUNK: tl.constexpr,
                F16: tl.constexpr):  # fmt: skip
    """Row ``t``'s query: the pointers ``q_row`` ``[TILE_H, 1]`` to its heads' rows, the
    tile ``[TILE_H, D_P2]`` (bf16 for bf16 dots, else fp32; with ``D_CHUNK`` a placeholder
    zero: the tiles read the query in chunks), the ``[TILE_H, D_P2]`` mask and the logits'
    scale (``qk_scale``; ``F16``: an fp16 tile and its scale, `query_f16`; ``F16`` 2 (``NIB``):
    its columns in nibble order, the tiles' 2^-14 on the scale)."""
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h64[:, None] * stride_qh
    qmask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    if D_CHUNK == 0:
        q = tl.load(q_row + d[None, :], mask=qmask, other=0.0)
        if F16:
            q, qk_scale = query_f16(q, qk_scale)
            if F16 == NIB:
                q, qk_scale = nibble_query(q, qk_scale)
        elif DOT_BF16:
            q = q.to(tl.bfloat16)
        else:
            q = q.to(tl.float32)
    else:
        q = 0.0
    return q, q_row, qmask, qk_scale


@jit(sizes=("slots0", "slots1"))
def sparse_attention_kernel(
    q_ptr, out_ptr, sink_ptr, stride_qt, stride_qh, stride_ot, stride_oh, num_heads, qk_scale,
    c0_ptr, i0_ptr, stride_i0, n0, slots0, bs0: tl.constexpr, sblk0, stok0, sstr0, soff0,
    c1_ptr, i1_ptr, stride_i1, n1, slots1, bs1: tl.constexpr, sblk1, stok1, sstr1, soff1,
    cos_ptr, sin_ptr, stride_rt,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr,
    KIND0: tl.constexpr, SF0: tl.constexpr, GS0: tl.constexpr, FLAT0: tl.constexpr,
    KIND1: tl.constexpr, SF1: tl.constexpr, GS1: tl.constexpr, FLAT1: tl.constexpr,
    HAS1: tl.constexpr, HW: tl.constexpr, DOT_BF16: tl.constexpr, D_CHUNK: tl.constexpr,
    PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, HALF_RD: tl.constexpr,
    F16: tl.constexpr = False, rows_ptr=None, HAS_ROWS: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, cdiv(H, TILE_H))``. q / out ``[T, H, D]``; sinks fp32 ``[H]``; per source
    ``i``: cache pointer, int32 index ``[T, n_i]`` (row stride ``stride_i``), ``slots_i``
    addressable slots, ``block_size``, block / token strides and scale offset (in elements
    of the pointer's dtype: bytes for quantized sources). ``D_CHUNK``: see ``_attend_tile``
    (0 or a power of two dividing ``D_P2``); ``F16``: fp16 products over e2m1 / e4m3-scale
    sources (`_load_key_cols`). ``HAS_ROWS``: grid ``(R, cdiv(H, TILE_H))``, program ``r``
    owns row ``rows[r]`` (int32 ``[R]``); the other rows of out are not written."""
    t = tl.load(rows_ptr + tl.program_id(0)) if HAS_ROWS else tl.program_id(0)
    heads = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    h_ok = heads < num_heads
    d = tl.arange(0, D_P2)
    h64 = heads.to(tl.int64)
    q, q_row, qmask, qk_scale = _load_query(q_ptr, t, h64, h_ok, d, stride_qt, stride_qh,
                                            qk_scale, HEAD_DIM, DOT_BF16, D_CHUNK,
                                            F16)  # fmt: skip
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.maximum(sink, -1.0e30)
    l_i = tl.exp2(sink - m_i)
    acc = _acc_zeros(TILE_H, D_P2, PV_SPLIT)
    acc, m_i, l_i = _attend_cols(
        acc, m_i, l_i, q, q_row, h_ok, t, 0, n0, c0_ptr, i0_ptr, stride_i0, slots0, bs0, sblk0,
        stok0, sstr0, soff0, qk_scale, KIND0, SF0, GS0, HEAD_DIM, D_P2, TILE_H, TILE_N, FLAT0,
        HW, DOT_BF16, D_CHUNK, PV_SPLIT, INTERPRET, F16,
    )  # fmt: skip
    if HAS1:
        acc, m_i, l_i = _attend_cols(
            acc, m_i, l_i, q, q_row, h_ok, t, 0, n1, c1_ptr, i1_ptr, stride_i1, slots1, bs1,
            sblk1, stok1, sstr1, soff1, qk_scale, KIND1, SF1, GS1, HEAD_DIM, D_P2, TILE_H,
            TILE_N, FLAT1, HW, DOT_BF16, D_CHUNK, PV_SPLIT, INTERPRET, F16,
        )  # fmt: skip
    inv = tl.where(l_i > 0, l_i, 1.0)[:, None]
    DC: tl.constexpr = D_P2 // PV_SPLIT
    for c in tl.static_range(PV_SPLIT):
        dc = c * DC + tl.arange(0, DC)
        o_off = t.to(tl.int64) * stride_ot + h64[:, None] * stride_oh + dc[None, :]
        o_mask = h_ok[:, None] & (dc < HEAD_DIM)[None, :]
        _store_out(acc_chunk(acc[c], F16) / inv, out_ptr + o_off, o_mask, cos_ptr, sin_ptr, t,
                   stride_rt, c * (DC // 2), TILE_H, DC, HEAD_DIM, HALF_RD, HW)  # fmt: skip


@jit
def _store_out(
    o, ptrs, mask, cos_ptr, sin_ptr, t, stride_rt, pair0, TILE_H: tl.constexpr,
    DC: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_RD: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Store ``o`` ``[TILE_H, DC]`` (fp32; head columns ``2 * pair0 + [0, DC)``) in the
    pointers' dtype. ``HALF_RD > 0``: first the inverse rotation of the rounded values on the
    head's trailing ``2 * HALF_RD`` channels, pair ``j`` (channels ``2j, 2j + 1``) by row
    ``t``'s ``cos / sin[j]`` (``[T, HALF_RD]`` tables, row stride ``stride_rt``)::

        y0 = x0 * c - x1 * (-s),  y1 = x1 * c + x0 * (-s)

    with each product rounded to fp32 on its own (``mul_rn``: not contracted into an FMA),
    the operations of ``norm_rope``'s torch path and kernel. ``t``: the row of every tile row,
    or ``[TILE_H, 1]`` rows (tiles whose rows are several query rows' heads)."""
    dtype: tl.constexpr = ptrs.dtype.element_ty
    if HALF_RD == 0:
        tl.store(ptrs, o.to(dtype), mask=mask)
    else:
        x0, x1 = tl.split(tl.reshape(o.to(dtype).to(tl.float32), [TILE_H, DC // 2, 2]))
        pair = pair0 + tl.arange(0, DC // 2) - (HEAD_DIM // 2 - HALF_RD)
        rot = (pair >= 0) & (pair < HALF_RD)
        row = t.to(tl.int64) * stride_rt  # a row, or [TILE_H, 1] rows (one per tile row)
        c = tl.load(cos_ptr + row + pair[None, :], mask=rot[None, :], other=1.0).to(tl.float32)
        s = -tl.load(sin_ptr + row + pair[None, :], mask=rot[None, :], other=0.0).to(tl.float32)
        if HW:
            y0 = libdevice.mul_rn(x0, c) - libdevice.mul_rn(x1, s)
            y1 = libdevice.mul_rn(x1, c) + libdevice.mul_rn(x0, s)
        else:
            y0 = x0 * c - x1 * s
            y1 = x1 * c + x0 * s
        y0 = tl.where(rot[None, :], y0, x0)
        y1 = tl.where(rot[None, :], y1, x1)
        y = tl.reshape(tl.join(y0, y1), [TILE_H, DC])
        tl.store(ptrs, y.to(dtype), mask=mask)


@jit
def index_scores_kernel(
    q_ptr, w_ptr, out_ptr, c_ptr, idx_ptr, stride_qt, stride_qh, stride_wt, stride_ot,
    stride_idx, num_heads, num_cols, num_slots, block_size: tl.constexpr, stride_block,
    stride_token, scale_stride, scale_offset,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, FLAT: tl.constexpr,
    HW: tl.constexpr,
):  # fmt: skip
    """Grid ``(T, cdiv(K, TILE_N))``: ``out[t, k] = sum_h w[t, h] * relu(q[t, h] . key)``
    (fp32, ``"ieee"`` products) for the key of slot ``index[t, k]``; ``-inf`` where the slot
    is ``-1``. q ``[T, Hi, Ci]``, w ``[T, Hi]``, ``TILE_H >= Hi``."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    heads = tl.arange(0, TILE_H)
    h_ok = heads < num_heads
    d = tl.arange(0, D_P2)
    t64 = t.to(tl.int64)
    q_off = t64 * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=h_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    w = tl.load(w_ptr + t64 * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32)
    slots = tl.load(idx_ptr + t64 * stride_idx + cols, mask=cols < num_cols, other=-1)
    valid = (slots >= 0) & (slots < num_slots)
    k = _load_keys(c_ptr, slots, valid, block_size, stride_block, stride_token, scale_stride,
                   scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N, FLAT, HW)  # fmt: skip
    s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")  # [TILE_H, TILE_N]
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t64 * stride_ot + cols, score, mask=cols < num_cols)


@jit
def index_scores_tc_kernel(
    q_ptr, w_ptr, out_ptr, c_ptr, idx_ptr, stride_qt, stride_qh, stride_wt, stride_ot,
    stride_idx, num_heads, num_cols, num_slots, block_size: tl.constexpr, stride_block,
    stride_token, scale_stride, scale_offset,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr,
    TILES: tl.constexpr, KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr,
    FLAT: tl.constexpr, HW: tl.constexpr, DOT_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(T, cdiv(K, TILES * TILE_N))``: the scores of ``index_scores_kernel`` with
    the keys as the dot's rows (``[TILE_N, Ci] x [Ci, TILE_H]``: every head of the row in one
    dot, the query tile loaded once for ``TILES`` key tiles). With ``DOT_BF16`` (bf16
    queries) the query and the dequantized keys (bf16-exact) enter the tensor cores as bf16
    with fp32 accumulation: exact products, only the summation order differs from fp32.
    Otherwise fp32 with ``"ieee"`` precision."""
    t = tl.program_id(0)
    heads = tl.arange(0, TILE_H)
    h_ok = heads < num_heads
    d = tl.arange(0, D_P2)
    t64 = t.to(tl.int64)
    q_off = t64 * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=h_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    if DOT_BF16:
        qt = tl.trans(q.to(tl.bfloat16))  # [D_P2, TILE_H]
    else:
        qt = tl.trans(q.to(tl.float32))
    w = tl.load(w_ptr + t64 * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32)
    for i in range(0, TILES):
        cols = (tl.program_id(1) * TILES + i) * TILE_N + tl.arange(0, TILE_N)
        c_ok = cols < num_cols
        slots = tl.load(idx_ptr + t64 * stride_idx + cols, mask=c_ok, other=-1)
        valid = (slots >= 0) & (slots < num_slots)
        k = _load_keys(c_ptr, slots, valid, block_size, stride_block, stride_token,
                       scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N,
                       FLAT, HW)  # fmt: skip
        if DOT_BF16:
            s = tl.dot(k.to(tl.bfloat16), qt)  # [TILE_N, TILE_H]
        else:
            s = tl.dot(k, qt, input_precision="ieee")
        score = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1)
        score = tl.where(valid, score, float("-inf"))
        tl.store(out_ptr + t64 * stride_ot + cols, score, mask=c_ok)


@jit
def index_scores_seq_kernel(
    q_ptr, w_ptr, out_ptr, c_ptr, idx_ptr, len_ptr, block_row_ptr, block_end_ptr,
    block_seq_ptr, stride_qt, stride_qh, stride_wt, stride_ot, stride_idx, num_heads,
    num_cols, num_slots, block_size: tl.constexpr, stride_block, stride_token, scale_stride,
    scale_offset,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr,
    ROWS: tl.constexpr, KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr,
    FLAT: tl.constexpr, HW: tl.constexpr, DOT_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_blocks, cdiv(K, TILE_N))``: ``index_scores_tc_kernel``'s scores for rows
    that share their candidates. Block ``b`` is rows ``block_row[b] .. block_end[b] - 1``
    (at most ``ROWS``) of sequence ``block_seq[b]``, whose candidate slots are row
    ``block_seq[b]`` of ``idx`` ``[S, K]``; row ``r`` sees the columns below ``len[r]``. The
    key tile is loaded and dequantized once for the block's rows, and one dot scores it
    against every head of every row (``[TILE_N, Ci] x [Ci, ROWS * TILE_H]``)."""
    b = tl.program_id(0)
    r0 = tl.load(block_row_ptr + b)
    r_end = tl.load(block_end_ptr + b)
    seq = tl.load(block_seq_ptr + b).to(tl.int64)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    c_ok = cols < num_cols
    slots = tl.load(idx_ptr + seq * stride_idx + cols, mask=c_ok, other=-1)
    valid = (slots >= 0) & (slots < num_slots)
    k = _load_keys(c_ptr, slots, valid, block_size, stride_block, stride_token, scale_stride,
                   scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N, FLAT, HW)  # fmt: skip
    # the block's (row, head) pairs as the dot's columns: pair p = row p // TILE_H
    p = tl.arange(0, ROWS * TILE_H)
    rows = r0 + p // TILE_H
    heads = p % TILE_H
    p_ok = (rows < r_end) & (heads < num_heads)
    d = tl.arange(0, D_P2)
    q_off = rows.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=p_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    w = tl.load(w_ptr + rows.to(tl.int64) * stride_wt + heads, mask=p_ok, other=0.0)
    if DOT_BF16:
        s = tl.dot(k.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))  # [TILE_N, ROWS * TILE_H]
    else:
        s = tl.dot(k, tl.trans(q.to(tl.float32)), input_precision="ieee")
    sc = tl.maximum(s, 0.0) * w.to(tl.float32)[None, :]
    score = tl.sum(tl.reshape(sc, [TILE_N, ROWS, TILE_H]), 2)  # [TILE_N, ROWS]
    r = r0 + tl.arange(0, ROWS)
    r_ok = r < r_end
    lens = tl.load(len_ptr + r, mask=r_ok, other=0)
    ok = valid[:, None] & (cols[:, None] < lens[None, :])
    score = tl.where(ok, score, float("-inf"))
    dst = out_ptr + r.to(tl.int64)[None, :] * stride_ot + cols[:, None]
    tl.store(dst, score, mask=c_ok[:, None] & r_ok[None, :])
