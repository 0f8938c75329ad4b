"""Triton kernels of the grouped MoE path (launched by `kvplan.ops.moe_grouped`).

The ``T * k`` (token, expert) pairs are sorted by expert; position ``p`` of that order is a
row of the intermediate buffers. A tile map (``tile_expert``, ``tile_start``, ``tile_end``, all
int32 ``[num_tiles]``, built on the device) gives each M tile its expert and its slice
``[start, end)`` of sorted positions, at most ``BLOCK_M`` long and inside one expert; a tile
with ``start >= end`` is unused and its programs exit at once. Every value torch materializes
in the activation dtype is rounded to it here too.

The two GEMM kernels loop over ``K_TILES`` (a constexpr, so Triton software-pipelines the
loads over ``num_stages``); ``EVEN_K`` / ``EVEN_N`` drop the K masks / clamp no columns when
the tiles divide the sizes. A padding row of a tile loads a valid row of its tile (never
stored). ``N_MAJOR`` swaps the grid axes so the programs of one M tile run side by side
(its activation rows and the expert's weights shared in L2); the grid is then
``(cdiv(N, BLOCK_N), num_tiles)``.

- ``grouped_gate_up_kernel``: grid ``(num_tiles, cdiv(I, BLOCK_N))``;
  ``h[p] = round(round(silu(min(g, limit))) * clamp(u, -limit, limit))`` with
  ``g | u = round(x[row[p]] @ gate_up[e]^T)``.
- ``grouped_down_kernel``: grid ``(num_tiles, cdiv(H, BLOCK_N))``;
  ``c[p] = round(round(h[p] @ down[e]^T) * w[p])``.
- ``grouped_combine_kernel``: grid ``(T, cdiv(H, TILE_H))``;
  ``out[t] = round(round(sum_j c[pos[t, j]]) (+ add[t]))``, fp32, ``j`` in the given order.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._moe_kernels import swiglu_values
from kvplan.ops._triton_util import round_to as _round


@jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` widens half-precision operands to fp32 first (exact
    products: the CPU interpreter's half-precision dot is unreliable)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@jit
def _tile(
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr, N_MAJOR: tl.constexpr
):
    """(expert int64, sorted positions ``[BLOCK_M]`` int64, their mask, the positions clamped
    into the tile (safe to load unmasked), empty flag, column tile index)."""
    if N_MAJOR:
        tile = tl.program_id(1)
        col_tile = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        col_tile = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    ex = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pos = start.to(tl.int64) + tl.arange(0, BLOCK_M)
    pmask = pos < end
    return ex, pos, pmask, tl.where(pmask, pos, start), start >= end, col_tile


@jit
def _col_tile(col_tile, n, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """(output columns of column tile ``col_tile``, their mask below ``n``, the columns to
    load: past ``n`` they read column 0, never stored)."""
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    return cols, cmask, cols if EVEN_N else tl.where(cmask, cols, 0)


@jit
def grouped_gate_up_kernel(
    x_ptr, w_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, h_ptr,
    hidden, inter, limit, stride_x,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, N_MAJOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    ex, pos, pmask, pos_in, empty, col_tile = _tile(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M, N_MAJOR
    )
    if empty:
        return
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    rows = tl.load(rows_ptr + pos_in).to(tl.int64)  # padding rows repeat the tile's first
    cols, cmask, cols_in = _col_tile(col_tile, inter, BLOCK_N, EVEN_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + ex * (2 * inter) * hidden + cols_in[None, :] * hidden + ks[:, None]
    u_ptrs = g_ptrs + inter * hidden
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(K_TILES):  # a static trip count: software-pipelined (num_stages)
        if EVEN_K:
            a = tl.load(a_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            kmask = kt * BLOCK_K + ks < hidden
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=kmask[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=kmask[:, None], other=0.0)
        acc_g = _dot(a, bg, acc_g, DOT_PRECISION, UPCAST)
        acc_u = _dot(a, bu, acc_u, DOT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = swiglu_values(_round(acc_g, dtype), _round(acc_u, dtype), limit, dtype)
    tl.store(h_ptr + pos[:, None] * inter + cols[None, :], h, mask=pmask[:, None] & cmask[None, :])


@jit
def grouped_down_kernel(
    h_ptr, w_ptr, wt_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, c_ptr,
    hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, N_MAJOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    ex, pos, pmask, pos_in, empty, col_tile = _tile(
        tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M, N_MAJOR
    )
    if empty:
        return
    dtype: tl.constexpr = c_ptr.dtype.element_ty
    cols, cmask, cols_in = _col_tile(col_tile, hidden, BLOCK_N, EVEN_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pos_in[:, None] * inter + ks[None, :]
    b_ptrs = w_ptr + ex * hidden * inter + cols_in[None, :] * inter + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(K_TILES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = kt * BLOCK_K + ks < inter
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    wt = tl.load(wt_ptr + pos, mask=pmask, other=0.0).to(tl.float32)
    c = _round(acc, dtype) * wt[:, None]
    tl.store(
        c_ptr + pos[:, None] * hidden + cols[None, :], c.to(dtype),
        mask=pmask[:, None] & cmask[None, :],
    )  # fmt: skip


@jit
def grouped_combine_kernel(
    c_ptr, pos_ptr, add_ptr, out_ptr, hidden,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, TILE_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    mask = hs < hidden
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros([TILE_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(c_ptr + p * hidden + hs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        add = tl.load(add_ptr + t * hidden + hs, mask=mask, other=0.0).to(tl.float32)
        acc = _round(acc, dtype) + add
    tl.store(out_ptr + t * hidden + hs, acc.to(dtype), mask=mask)


# ---- the grouping: the T*k pairs sorted by expert, on the device, in three launches ---------
#
# The pairs are cut into chunks of ``TOK`` tokens (``TOK * k`` pairs, flat order). A pair's
# sorted position is ``offsets[e] + (pairs of e in earlier chunks) + (pairs of e before it in
# its chunk)``, the stable order by expert:
#
# - ``group_count_kernel`` (grid: chunks): each chunk's per-expert counts, also added
#   atomically into the totals (integer adds: any order gives the same sums);
# - ``group_scan_kernel`` (grid: expert blocks + 1): per expert, the exclusive running count
#   over the chunks (``base[c, e]``, offsets included); the last program writes ``offsets``
#   and the M-tile map from the totals;
# - ``group_place_kernel`` (grid: chunks): each pair's rank in its chunk (a one-hot prefix
#   count), its position, and the scatters of ``order``, ``rows``, the routing weight and each
#   token's positions in ascending order.


@jit
def _chunk_hits(ids_ptr, chunk, num_tokens, K: tl.constexpr, K_P2: tl.constexpr,
                TOK: tl.constexpr, E_P2: tl.constexpr):  # fmt: skip
    """(flat pair indices int64 ``[TOK, K_P2]``, their mask, expert of each pair in flat order
    ``[TOK * K_P2]`` (-1 masked), one-hot int32 ``[TOK * K_P2, E_P2]``) of chunk ``chunk``."""
    toks = chunk.to(tl.int64) * TOK + tl.arange(0, TOK)
    slots = tl.arange(0, K_P2)
    valid = (toks[:, None] < num_tokens) & (slots[None, :] < K)
    flat = toks[:, None] * K + slots[None, :]
    ex = tl.load(ids_ptr + flat, mask=valid, other=-1).to(tl.int32)
    ex1 = tl.reshape(ex, [TOK * K_P2])
    hits = (ex1[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32)
    return flat, valid, ex1, hits


@jit
def group_count_kernel(
    ids_ptr, counts_ptr, totals_ptr, num_tokens,
    K: tl.constexpr, K_P2: tl.constexpr, TOK: tl.constexpr, E_P2: tl.constexpr,
):  # fmt: skip
    """``counts[c, e]`` (int32 ``[chunks, E_P2]``) pairs of expert ``e`` in chunk ``c``;
    ``totals[e] += counts[c, e]`` (``totals`` zeroed by the caller)."""
    chunk = tl.program_id(0)
    _, _, _, hits = _chunk_hits(ids_ptr, chunk, num_tokens, K, K_P2, TOK, E_P2)
    counts = tl.sum(hits, axis=0)
    lanes = tl.arange(0, E_P2)
    tl.store(counts_ptr + chunk.to(tl.int64) * E_P2 + lanes, counts)
    tl.atomic_add(totals_ptr + lanes, counts, mask=counts > 0)


@jit
def group_scan_kernel(
    counts_ptr, totals_ptr, base_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr,
    tile_end_ptr, num_chunks, num_experts, num_pairs, num_tiles, block_m,
    E_P2: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr,
):  # fmt: skip
    """Programs ``0 .. E_P2 / EB - 1``: ``base[c, e] = offsets[e] + sum_{c' < c} counts[c', e]``
    for their ``EB`` experts. Program ``E_P2 / EB``: ``offsets`` (int64 ``[E + 1]``) and the
    tile map (``num_tiles`` entries, unused ones ``start == end == 0``, expert clamped to
    ``E - 1``, as `kvplan.ops.moe_grouped.group_pairs` builds them)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, E_P2)
    totals = tl.load(totals_ptr + lanes)
    excl = tl.cumsum(totals, axis=0) - totals  # offsets[e] for every lane
    if pid < E_P2 // EB:
        own = pid * EB + tl.arange(0, EB)
        run = tl.load(totals_ptr + own)
        run = tl.cumsum(run, axis=0) - run + tl.sum(tl.where(lanes < pid * EB, totals, 0))
        c0 = 0
        while c0 < num_chunks:
            cs = c0 + tl.arange(0, CB)
            cmask = cs < num_chunks
            offs = cs.to(tl.int64)[:, None] * E_P2 + own[None, :]
            cnt = tl.load(counts_ptr + offs, mask=cmask[:, None], other=0)
            tl.store(base_ptr + offs, tl.cumsum(cnt, axis=0) - cnt + run[None, :],
                     mask=cmask[:, None])  # fmt: skip
            run += tl.sum(cnt, axis=0)
            c0 += CB
    else:
        tl.store(offsets_ptr + lanes, excl.to(tl.int64), mask=lanes < num_experts)
        one = tl.arange(0, 1)  # num_pairs may be a specialized constant: no scalar .to()
        tl.store(offsets_ptr + num_experts + one, tl.zeros([1], tl.int64) + num_pairs)
        tiles = (totals + block_m - 1) // block_m
        tile_end = tl.cumsum(tiles, axis=0)  # lanes past E: the total, never <= a used tile
        first = tile_end - tiles
        i0 = 0
        while i0 < num_tiles:
            idx = i0 + tl.arange(0, TB)
            imask = idx < num_tiles
            expert = tl.sum((tile_end[None, :] <= idx[:, None]).to(tl.int32), axis=1)
            used = expert < num_experts
            ex = tl.minimum(expert, num_experts - 1)
            sel = lanes[None, :] == ex[:, None]
            start = tl.sum(tl.where(sel, excl[None, :] + (idx[:, None] - first[None, :])
                                    * block_m, 0), axis=1)  # fmt: skip
            stop = tl.sum(tl.where(sel, (excl + totals)[None, :], 0), axis=1)
            end = tl.minimum(start + block_m, stop)
            tl.store(tile_expert_ptr + idx, ex, mask=imask)
            tl.store(tile_start_ptr + idx, tl.where(used, start, 0), mask=imask)
            tl.store(tile_end_ptr + idx, tl.where(used, end, 0), mask=imask)
            i0 += TB


@jit
def group_place_kernel(
    ids_ptr, w_ptr, base_ptr, order_ptr, rows_ptr, token_pos_ptr, w_sorted_ptr, num_tokens,
    K: tl.constexpr, K_P2: tl.constexpr, TOK: tl.constexpr, E_P2: tl.constexpr,
    HAS_W: tl.constexpr,
):  # fmt: skip
    """Each pair of chunk ``c``: ``pos = base[c, e] + (pairs of e before it in the chunk)``;
    ``order[pos] = flat``, ``rows[pos] = flat // K``, ``w_sorted[pos] = w[flat]`` (``HAS_W``),
    ``token_pos[t, r] = pos`` for the pair of rank ``r`` (ascending ``pos``) among ``t``'s."""
    chunk = tl.program_id(0)
    flat, valid, ex1, hits = _chunk_hits(ids_ptr, chunk, num_tokens, K, K_P2, TOK, E_P2)
    rank = tl.sum(tl.cumsum(hits, axis=0) * hits, axis=1) - 1  # [TOK * K_P2]
    valid1 = tl.reshape(valid, [TOK * K_P2])
    flat1 = tl.reshape(flat, [TOK * K_P2])
    base = tl.load(base_ptr + chunk.to(tl.int64) * E_P2 + ex1, mask=valid1, other=0)
    pos = (base + rank).to(tl.int64)
    tl.store(order_ptr + pos, flat1, mask=valid1)
    tl.store(rows_ptr + pos, (flat1 // K).to(tl.int32), mask=valid1)
    if HAS_W:
        w = tl.load(w_ptr + flat1, mask=valid1, other=0.0)
        tl.store(w_sorted_ptr + pos, w, mask=valid1)
    pos2 = tl.reshape(pos, [TOK, K_P2])
    key = tl.where(valid, pos2, num_tokens * K)  # masked slots sort last
    below = tl.sum((key[:, None, :] < key[:, :, None]).to(tl.int32), axis=2)  # [TOK, K_P2]
    toks = flat // K
    tl.store(token_pos_ptr + toks * K + below, pos2.to(tl.int32), mask=valid)
