"""Triton kernels of the grouped MoE path (launched by `kvplan.ops.moe_grouped`).

The ``T * k`` (token, expert) pairs are sorted by expert; position ``p`` of that order is a
row of the intermediate buffers. A tile map (``tile_expert``, ``tile_start``, ``tile_end``, all
int32 ``[num_tiles]``, built on the device) gives each M tile its expert and its slice
``[start, end)`` of sorted positions, at most ``BLOCK_M`` long and inside one expert; a tile
with ``start >= end`` is unused and its programs exit at once. Every value torch materializes
in the activation dtype is rounded to it here too.

- ``grouped_gate_up_kernel``: grid ``(num_tiles, cdiv(I, BLOCK_N))``;
  ``h[p] = round(round(silu(min(g, limit))) * clamp(u, -limit, limit))`` with
  ``g | u = round(x[row[p]] @ gate_up[e]^T)``.
- ``grouped_down_kernel``: grid ``(num_tiles, cdiv(H, BLOCK_N))``;
  ``c[p] = round(round(h[p] @ down[e]^T) * w[p])``.
- ``grouped_combine_kernel``: grid ``(T, cdiv(H, TILE_H))``;
  ``out[t] = round(round(sum_j c[pos[t, j]]) (+ add[t]))``, fp32, ``j`` in the given order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.ops._triton_util import round_to as _round


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` widens half-precision operands to fp32 first (exact
    products: the CPU interpreter's half-precision dot is unreliable)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """(expert int64, sorted positions ``[BLOCK_M]`` int64, their mask, empty flag)."""
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    ex = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pos = start.to(tl.int64) + tl.arange(0, BLOCK_M)
    return ex, pos, pos < end, start >= end


@triton.jit
def grouped_gate_up_kernel(
    x_ptr, w_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, h_ptr,
    hidden, inter, limit, stride_x,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    ex, pos, pmask, empty = _tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
    if empty:
        return
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    rows = tl.load(rows_ptr + pos, mask=pmask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    w_base = w_ptr + ex * (2 * inter) * hidden
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = 0  # while loops: the CPU interpreter takes no runtime ``range`` bound
    while k0 < hidden:
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < hidden
        a = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=pmask[:, None] & kmask[None, :], other=0.0,
        )  # fmt: skip
        bmask = kmask[:, None] & cmask[None, :]
        bg = tl.load(w_base + cols[None, :] * hidden + ks[:, None], mask=bmask, other=0.0)
        bu = tl.load(w_base + (cols[None, :] + inter) * hidden + ks[:, None], mask=bmask, other=0.0)
        acc_g = _dot(a, bg, acc_g, DOT_PRECISION, UPCAST)
        acc_u = _dot(a, bu, acc_u, DOT_PRECISION, UPCAST)
        k0 += BLOCK_K
    g = tl.minimum(_round(acc_g, dtype), limit)
    u = tl.minimum(tl.maximum(_round(acc_u, dtype), -limit), limit)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(
        h_ptr + pos[:, None] * inter + cols[None, :], (act * u).to(dtype),
        mask=pmask[:, None] & cmask[None, :],
    )  # fmt: skip


@triton.jit
def grouped_down_kernel(
    h_ptr, w_ptr, wt_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, c_ptr,
    hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    ex, pos, pmask, empty = _tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
    if empty:
        return
    dtype: tl.constexpr = c_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    w_base = w_ptr + ex * hidden * inter
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = 0
    while k0 < inter:
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < inter
        a = tl.load(
            h_ptr + pos[:, None] * inter + ks[None, :],
            mask=pmask[:, None] & kmask[None, :], other=0.0,
        )  # fmt: skip
        b = tl.load(
            w_base + cols[None, :] * inter + ks[:, None],
            mask=kmask[:, None] & cmask[None, :], other=0.0,
        )  # fmt: skip
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST)
        k0 += BLOCK_K
    wt = tl.load(wt_ptr + pos, mask=pmask, other=0.0).to(tl.float32)
    c = _round(acc, dtype) * wt[:, None]
    tl.store(
        c_ptr + pos[:, None] * hidden + cols[None, :], c.to(dtype),
        mask=pmask[:, None] & cmask[None, :],
    )  # fmt: skip


@triton.jit
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
