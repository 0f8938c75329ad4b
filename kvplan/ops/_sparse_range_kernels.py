"""Triton kernel of ``kvplan.ops.sparse_ranges``: sink attention where every query row sees
column ranges of its sources, several consecutive rows sharing each loaded key tile.

A prompt's rows see overlapping key sets: a sliding window moves one row a token, and a
compressed prefix grows one entry every ``ratio`` tokens. ``sparse_attention_kernel`` walks
each row's own index and loads every key once per row; here a program owns a block of up to
``TILE_T`` rows and ``TILE_H`` heads, and its tiles hold ``TILE_T * TILE_H`` query rows
(tile row ``p``: query row ``r_lo + p // TILE_H``, head ``g * TILE_H + p % TILE_H``). Per
source and range pair it walks the union of its rows' ranges in tiles of ``TILE_N`` slots,
loads (and dequantizes) each key tile once and masks each tile row to its own range::

    row t, pair j of source i: slots [start, start + length) = ranges_i[t, 2j], [t, 2j + 1]
    union over the block: [min start, max end) of its non-empty ranges

so the keys are read once per block instead of once per row, and the products run as one
``[TILE_T * TILE_H, D] x [D, TILE_N]`` dot (taller tiles for the tensor cores). The online
softmax, the sinks, the dequantization and the epilogue (``HALF_RD``: the inverse rotation)
are those of ``kvplan.ops._sparse_attention_kernels``: a tile row's masked columns add
``exp2(-inf) = 0`` and leave its running maximum, which starts from its sink, unchanged.

Grid ``(num_blocks, cdiv(H, TILE_H))``; block ``b`` is rows ``[blk_start[b], blk_end[b])``
(``BLOCKS``) or ``[b * TILE_T, min((b + 1) * TILE_T, T))``. Rows of a block should be
neighbours (one sequence): a block's union spans what any of its rows sees.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._sparse_attention_kernels import (
    LOG2E,
    _load_key_cols,
    _pv_step,
    _store_out,
    softmax_step,
)


@jit
def _range_step(
    acc, m_i, l_i, q, lo, hi, start, c_ptr, num_slots, block_size, stride_block,
    stride_token, scale_stride, scale_offset, qk_scale,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr, HW: tl.constexpr,
    DOT_BF16: tl.constexpr, u_lo, u_hi,
):  # fmt: skip
    """One online-softmax step over slots ``[start, start + TILE_N)`` for tile rows whose
    ranges are ``[lo, hi)`` (``[M]`` each; ``[u_lo, u_hi)`` their union)."""
    slots = start + tl.arange(0, TILE_N)
    valid = (slots >= u_lo) & (slots < u_hi) & (slots < num_slots)
    kd = _load_key_cols(c_ptr, slots, valid, 0, block_size, stride_block, stride_token,
                        scale_stride, scale_offset, KIND, SF, GS, HEAD_DIM, D_P2, TILE_N,
                        FLAT, HW, DOT_BF16)  # fmt: skip
    if DOT_BF16:
        s = tl.dot(q, tl.trans(kd))
    else:
        s = tl.dot(q, tl.trans(kd), input_precision="ieee")
    seen = (slots[None, :] >= lo[:, None]) & (slots[None, :] < hi[:, None]) & valid[None, :]
    p, alpha, m_new, l_i = softmax_step(s, seen, m_i, l_i, qk_scale)  # [M, TILE_N]
    if DOT_BF16:
        p = p.to(tl.bfloat16)
    acc = _pv_step(acc, alpha, p, kd, DOT_BF16)
    return acc, m_new, l_i


@jit
def _range_pair(
    acc, m_i, l_i, q, rows, ok, j, r_ptr, stride_r, c_ptr, num_slots, block_size, stride_block,
    stride_token, scale_stride, scale_offset, qk_scale,
    KIND: tl.constexpr, SF: tl.constexpr, GS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr, TILE_N: tl.constexpr, FLAT: tl.constexpr, HW: tl.constexpr,
    DOT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Range pair ``j`` of one source for the tile rows: their ``[start, start + length)``
    from ``ranges[rows, 2j:2j + 2]``, walked over the union of the non-empty ones."""
    r_off = rows.to(tl.int64) * stride_r + 2 * j
    lo = tl.load(r_ptr + r_off, mask=ok, other=0)
    ln = tl.load(r_ptr + r_off + 1, mask=ok, other=0)
    live = ok & (ln > 0)
    hi = tl.where(live, lo + ln, lo)
    u_lo = tl.min(tl.where(live, lo, 2147483647), 0)
    u_hi = tl.max(tl.where(live, hi, -2147483647), 0)
    if INTERPRET:
        start = u_lo
        while start < u_hi:
            acc, m_i, l_i = _range_step(
                acc, m_i, l_i, q, lo, hi, start, c_ptr, num_slots, block_size, stride_block,
                stride_token, scale_stride, scale_offset, qk_scale, KIND, SF, GS, HEAD_DIM,
                D_P2, TILE_N, FLAT, HW, DOT_BF16, u_lo, u_hi,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(u_lo, u_hi, TILE_N):
            acc, m_i, l_i = _range_step(
                acc, m_i, l_i, q, lo, hi, start, c_ptr, num_slots, block_size, stride_block,
                stride_token, scale_stride, scale_offset, qk_scale, KIND, SF, GS, HEAD_DIM,
                D_P2, TILE_N, FLAT, HW, DOT_BF16, u_lo, u_hi,
            )  # fmt: skip
    return acc, m_i, l_i


@jit(sizes=("num_rows", "slots0", "slots1"))
def sparse_ranges_kernel(
    q_ptr, out_ptr, sink_ptr, blk_start_ptr, blk_end_ptr, num_rows, stride_qt, stride_qh,
    stride_ot, stride_oh, num_heads, qk_scale,
    c0_ptr, r0_ptr, stride_r0, slots0, bs0: tl.constexpr, sblk0, stok0, sstr0, soff0,
    c1_ptr, r1_ptr, stride_r1, slots1, bs1: tl.constexpr, sblk1, stok1, sstr1, soff1,
    cos_ptr, sin_ptr, stride_rt,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_T: tl.constexpr, TILE_H: tl.constexpr,
    TILE_N: tl.constexpr,
    KIND0: tl.constexpr, SF0: tl.constexpr, GS0: tl.constexpr, FLAT0: tl.constexpr,
    PAIRS0: tl.constexpr,
    KIND1: tl.constexpr, SF1: tl.constexpr, GS1: tl.constexpr, FLAT1: tl.constexpr,
    PAIRS1: tl.constexpr,
    HAS1: tl.constexpr, BLOCKS: tl.constexpr, HW: tl.constexpr, DOT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr, HALF_RD: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_blocks, cdiv(H, TILE_H))`` (module docstring). q / out ``[T, H, D]``;
    sinks fp32 ``[H]``; per source ``i``: cache pointer, int32 ranges ``[T, 2 * PAIRS_i]``
    (row stride ``stride_r_i``), addressable slots and the addressing of
    ``sparse_attention_kernel``'s sources."""
    b = tl.program_id(0)
    if BLOCKS:
        r_lo = tl.load(blk_start_ptr + b)
        r_hi = tl.load(blk_end_ptr + b)
    else:
        r_lo = b * TILE_T
        r_hi = tl.minimum(r_lo + TILE_T, num_rows)
    M: tl.constexpr = TILE_T * TILE_H
    p = tl.arange(0, M)
    rows = r_lo + p // TILE_H
    heads = tl.program_id(1) * TILE_H + p % TILE_H
    ok = (rows < r_hi) & (heads < num_heads)
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, D_P2)
    q_off = rows64[:, None] * stride_qt + heads.to(tl.int64)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    if DOT_BF16:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(tl.float32)
    sink = tl.load(sink_ptr + heads, mask=ok, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.maximum(sink, -1.0e30)
    l_i = tl.exp2(sink - m_i)
    acc = tl.zeros([M, D_P2], tl.float32)
    for j in tl.static_range(PAIRS0):
        acc, m_i, l_i = _range_pair(
            acc, m_i, l_i, q, rows, ok, j, r0_ptr, stride_r0, c0_ptr, slots0, bs0, sblk0,
            stok0, sstr0, soff0, qk_scale, KIND0, SF0, GS0, HEAD_DIM, D_P2, TILE_N, FLAT0, HW,
            DOT_BF16, INTERPRET,
        )  # fmt: skip
    if HAS1:
        for j in tl.static_range(PAIRS1):
            acc, m_i, l_i = _range_pair(
                acc, m_i, l_i, q, rows, ok, j, r1_ptr, stride_r1, c1_ptr, slots1, bs1, sblk1,
                stok1, sstr1, soff1, qk_scale, KIND1, SF1, GS1, HEAD_DIM, D_P2, TILE_N, FLAT1,
                HW, DOT_BF16, INTERPRET,
            )  # fmt: skip
    inv = tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = rows64[:, None] * stride_ot + heads.to(tl.int64)[:, None] * stride_oh + d[None, :]
    o_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    rope_rows = tl.minimum(rows, num_rows - 1)[:, None]  # in bounds for the masked rows
    _store_out(acc / inv, out_ptr + o_off, o_mask, cos_ptr, sin_ptr, rope_rows, stride_rt, 0,
               M, D_P2, HEAD_DIM, HALF_RD, HW)  # fmt: skip
