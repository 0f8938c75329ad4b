"""Split-column (flash-decoding) kernels of ``kvplan.ops.sparse_attention``.

A few query rows (decode) give ``T * cdiv(H, TILE_H)`` programs, too few to fill the GPU when
each walks all of its row's columns. Here the columns of a row, source 0's then source 1's
(one joined column space of ``n0 + n1`` columns), are cut into ``S`` splits of
``cols_per_split`` columns (a multiple of ``TILE_N``)::

    columns:  | source 0: n0 ............ | source 1: n1 ..................... |
    splits:   | split 0     | split 1     | split 2     | split 3     | s 4    |

``sparse_attention_split_kernel`` (grid ``(T, cdiv(H, TILE_H), S)``) runs the online softmax
of ``kvplan.ops._sparse_attention_kernels`` over one split, without the sink, and writes its
partial state, in the log2 domain, to fp32 workspaces::

    ws_m[t, s, h]     running max of the split's logits (-1e30 when it saw no column)
    ws_l[t, s, h]     sum_k exp2(l_k - ws_m)
    ws_acc[t, s, h]   sum_k exp2(l_k - ws_m) v_k        [D]

``sparse_attention_combine_kernel`` (grid ``(T, cdiv(H, TILE_H))``) merges the splits and
adds the sink once: ``m = max(sink, max_s ws_m)``, ``l = exp2(sink - m) + sum_s ws_l
exp2(ws_m - m)``, ``out = sum_s ws_acc exp2(ws_m - m) / l`` (zeros for a row that sees no
key). The workspaces hold ``T * S * H * (D + 2)`` fp32 values, a size fixed by the shapes.

``FUSED`` (one launch instead of two): each split program, once its partial is written,
counts itself in on its (row, head group)'s int32 counter (an atomic, acquire-release at GPU
scope, after a barrier over the program's own stores); the program that arrives last merges
the ``S`` partials exactly as the combine kernel does (the same order, the same bits,
whichever program is last; it reads them past the L1 cache) and resets the counter to zero,
so the counters are left zeroed for the next launch or graph replay.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._sparse_attention_kernels import (
    LOG2E,
    _acc_zeros,
    _attend_cols,
    _load_query,
    _store_out,
    acc_chunk,
)


@jit(sizes=("slots0", "slots1"))
def sparse_attention_split_kernel(
    q_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, stride_qt, stride_qh, num_heads, num_splits,
    cols_per_split, qk_scale,
    c0_ptr, i0_ptr, stride_i0, n0, slots0, bs0: tl.constexpr, sblk0, stok0, sstr0, soff0,
    c1_ptr, i1_ptr, stride_i1, n1, slots1, bs1: tl.constexpr, sblk1, stok1, sstr1, soff1,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, TILE_N: tl.constexpr,
    KIND0: tl.constexpr, SF0: tl.constexpr, GS0: tl.constexpr, FLAT0: tl.constexpr,
    KIND1: tl.constexpr, SF1: tl.constexpr, GS1: tl.constexpr, FLAT1: tl.constexpr,
    HAS1: tl.constexpr, HW: tl.constexpr, DOT_BF16: tl.constexpr, D_CHUNK: tl.constexpr,
    PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    out_ptr=None, sink_ptr=None, cnt_ptr=None, stride_ot=0, stride_oh=0, cos_ptr=None,
    sin_ptr=None, stride_rt=0, FUSED: tl.constexpr = False, HALF_RD: tl.constexpr = 0,
    F16: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, cdiv(H, TILE_H), S)``: split ``s`` of row ``t``, joined columns
    ``[s * cols_per_split, (s + 1) * cols_per_split)``. Source arguments as in
    ``sparse_attention_kernel``; workspaces contiguous ``[T, S, H(, HEAD_DIM)]`` fp32.
    ``FUSED``: the last program of a (row, head group) also merges (the combine kernel's
    arguments; ``cnt_ptr``: int32 ``[T * cdiv(H, TILE_H)]`` counters, zero on entry)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    sp = tl.program_id(2)
    h_ok = heads < num_heads
    d = tl.arange(0, D_P2)
    h64 = heads.to(tl.int64)
    q, q_row, qmask, qk_scale = _load_query(q_ptr, t, h64, h_ok, d, stride_qt, stride_qh,
                                            qk_scale, HEAD_DIM, DOT_BF16, D_CHUNK,
                                            F16)  # fmt: skip
    m_i = tl.full([TILE_H], -1.0e30, tl.float32)
    l_i = tl.zeros([TILE_H], tl.float32)
    acc = _acc_zeros(TILE_H, D_P2, PV_SPLIT)
    lo = sp * cols_per_split
    hi = lo + cols_per_split
    acc, m_i, l_i = _attend_cols(
        acc, m_i, l_i, q, q_row, h_ok, t, tl.minimum(lo, n0), tl.minimum(hi, n0), c0_ptr,
        i0_ptr, stride_i0, slots0, bs0, sblk0, stok0, sstr0, soff0, qk_scale,
        KIND0, SF0, GS0, HEAD_DIM, D_P2, TILE_H, TILE_N, FLAT0, HW, DOT_BF16, D_CHUNK,
        PV_SPLIT, INTERPRET, F16,
    )  # fmt: skip
    if HAS1:
        lo1 = tl.minimum(tl.maximum(lo - n0, 0), n1)
        hi1 = tl.minimum(tl.maximum(hi - n0, 0), n1)
        acc, m_i, l_i = _attend_cols(
            acc, m_i, l_i, q, q_row, h_ok, t, lo1, hi1, c1_ptr, i1_ptr, stride_i1, slots1,
            bs1, sblk1, stok1, sstr1, soff1, qk_scale,
            KIND1, SF1, GS1, HEAD_DIM, D_P2, TILE_H, TILE_N, FLAT1, HW, DOT_BF16, D_CHUNK,
            PV_SPLIT, INTERPRET, F16,
        )  # fmt: skip
    row = (t.to(tl.int64) * num_splits + sp) * num_heads + h64  # [TILE_H]
    tl.store(ws_m_ptr + row, m_i, mask=h_ok)
    tl.store(ws_l_ptr + row, l_i, mask=h_ok)
    DC: tl.constexpr = D_P2 // PV_SPLIT
    for c in tl.static_range(PV_SPLIT):
        dc = c * DC + tl.arange(0, DC)
        mask = h_ok[:, None] & (dc < HEAD_DIM)[None, :]
        tl.store(ws_acc_ptr + row[:, None] * HEAD_DIM + dc[None, :], acc_chunk(acc[c], F16),
                 mask=mask)  # fmt: skip
    if FUSED:
        tl.debug_barrier()  # every thread's stores above, before the count
        counter = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            _merge_splits(out_ptr, sink_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, stride_ot,
                          stride_oh, num_heads, num_splits, cos_ptr, sin_ptr, stride_rt, t,
                          heads, HEAD_DIM, D_P2, TILE_H, INTERPRET, HALF_RD, HW,
                          ".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@jit
def _split_weight(ws_m_ptr, row, h_ok, m, CACHE: tl.constexpr):
    """``exp2(ws_m - m)`` of one split's heads (``[TILE_H]``)."""
    return tl.exp2(_ws_load(ws_m_ptr + row, h_ok, -1.0e30, CACHE) - m)


@jit
def sparse_attention_combine_kernel(
    out_ptr, sink_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, stride_ot, stride_oh, num_heads,
    num_splits, cos_ptr, sin_ptr, stride_rt,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, INTERPRET: tl.constexpr,
    HALF_RD: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Grid ``(T, cdiv(H, TILE_H))``: merge the ``S`` partial states of row ``t`` and add
    the sink (fp32 ``[H]``) once; out ``[T, H, HEAD_DIM]`` (``HALF_RD``: its rotary channels
    turned back, ``_store_out``)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    _merge_splits(out_ptr, sink_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, stride_ot, stride_oh,
                  num_heads, num_splits, cos_ptr, sin_ptr, stride_rt, t, heads, HEAD_DIM, D_P2,
                  TILE_H, INTERPRET, HALF_RD, HW, "")  # fmt: skip


@jit
def _merge_splits(
    out_ptr, sink_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, stride_ot, stride_oh, num_heads,
    num_splits, cos_ptr, sin_ptr, stride_rt, t, heads,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, TILE_H: tl.constexpr, INTERPRET: tl.constexpr,
    HALF_RD: tl.constexpr, HW: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """The merge of row ``t``'s ``S`` partial states for ``heads`` (the combine kernel's
    program; ``CACHE``: the workspace loads' cache modifier, ``".cg"`` past the L1 when other
    programs of the same launch wrote them)."""
    h_ok = heads < num_heads
    h64 = heads.to(tl.int64)
    d = tl.arange(0, D_P2)
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    base = t.to(tl.int64) * num_splits * num_heads + h64  # row of split 0
    m = tl.maximum(sink, -1.0e30)
    if INTERPRET:  # no runtime range bound in the interpreter
        sp = 0
        while sp < num_splits:
            m = tl.maximum(m, _ws_load(ws_m_ptr + base + sp * num_heads, h_ok, -1.0e30, CACHE))
            sp += 1
    else:
        for sp in range(0, num_splits):
            m = tl.maximum(m, _ws_load(ws_m_ptr + base + sp * num_heads, h_ok, -1.0e30, CACHE))
    l_i = tl.exp2(sink - m)
    acc = tl.zeros([TILE_H, D_P2], tl.float32)
    if INTERPRET:
        sp = 0
        while sp < num_splits:
            acc, l_i = _merge_split(acc, l_i, m, base + sp * num_heads, h_ok, d, mask, ws_acc_ptr,
                                    ws_m_ptr, ws_l_ptr, HEAD_DIM, CACHE)  # fmt: skip
            sp += 1
    else:
        for sp in range(0, num_splits):
            acc, l_i = _merge_split(acc, l_i, m, base + sp * num_heads, h_ok, d, mask, ws_acc_ptr,
                                    ws_m_ptr, ws_l_ptr, HEAD_DIM, CACHE)  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = t.to(tl.int64) * stride_ot + h64[:, None] * stride_oh + d[None, :]
    _store_out(o, out_ptr + o_off, mask, cos_ptr, sin_ptr, t, stride_rt, 0, TILE_H, D_P2,
               HEAD_DIM, HALF_RD, HW)  # fmt: skip


@jit
def _ws_load(ptrs, mask, other, CACHE: tl.constexpr):
    """A masked workspace load with cache modifier ``CACHE``."""
    return tl.load(ptrs, mask=mask, other=other, cache_modifier=CACHE)


@jit
def _merge_split(
    acc, l_i, m, row, h_ok, d, mask, ws_acc_ptr, ws_m_ptr, ws_l_ptr, HEAD_DIM: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    """Add one split's partial state (workspace rows ``row``, ``[TILE_H]``) into ``acc`` /
    ``l_i`` at the running maximum ``m``."""
    w = _split_weight(ws_m_ptr, row, h_ok, m, CACHE)
    l_i += w * _ws_load(ws_l_ptr + row, h_ok, 0.0, CACHE)
    part = _ws_load(ws_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask, 0.0, CACHE)
    return acc + w[:, None] * part, l_i
