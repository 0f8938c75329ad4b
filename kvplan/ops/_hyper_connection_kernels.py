"""Triton kernels of the manifold-constrained hyper-connections (launched by
`kvplan.ops.hyper_connection`).

A hyper-connection's weights come from ``f = RMSNorm(s.flatten) @ fn^T``; the norm is a per-row
scalar, so it is applied after the projection: ``f = (s @ fn^T) * rsqrt(mean(s^2) + eps)``.

- ``hc_proj_kernel``: grid ``(cdiv(T, TILE_T), num_splits)``; split-K partial projection of
  ``s [T, K]`` (``K = n * hidden``) on ``fn [N_OUT, K]`` (fp32, ``tl.dot`` in IEEE fp32) and
  partial sums of squares, written to ``part [num_splits, T, N_PAD]`` and ``sq [num_splits, T]``.
- ``hc_pre_kernel``: grid ``(T, cdiv(hidden, TILE_H))``; adds the partials of one token, forms
  ``pre`` (and, unless ``HEAD``, ``post`` and the Sinkhorn-normalised ``comb``, written by the
  programs of hidden tile 0) in registers and writes ``x = sum_i pre[i] * s[i]`` for its tile.
- ``hc_post_kernel``: grid ``(T, cdiv(hidden, TILE_H))``;
  ``s'[k] = round(round(post[k] * out) + round(sum_j comb[j, k] * s[j]))`` with ``post`` and
  ``comb`` first rounded to ``s``'s dtype, as the torch path's ``matmul`` in that dtype does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.ops._triton_util import round_to as _round


@triton.jit
def hc_proj_kernel(
    s_ptr, fn_ptr, part_ptr, sq_ptr, num_rows, k_total, k_per_split, n_out,
    TILE_T: tl.constexpr, TILE_K: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    """``part[p, t, o] = sum_{k in split p} s[t, k] * fn[o, k]``; ``sq[p, t] = sum s[t, k]^2``."""
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * TILE_T + tl.arange(0, TILE_T)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    outs = tl.arange(0, N_PAD)
    omask = outs < n_out
    acc = tl.zeros([TILE_T, N_PAD], dtype=tl.float32)
    sq = tl.zeros([TILE_T], dtype=tl.float32)
    k_lo = split * k_per_split
    k0 = 0  # while loops: the CPU interpreter takes no runtime ``range`` bound
    while k0 < k_per_split:
        ks = k_lo + k0 + tl.arange(0, TILE_K)
        kmask = (ks < k_total) & (ks < k_lo + k_per_split)
        x = tl.load(
            s_ptr + rows64[:, None] * k_total + ks[None, :],
            mask=rmask[:, None] & kmask[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        w = tl.load(
            fn_ptr + outs[:, None] * k_total + ks[None, :],
            mask=omask[:, None] & kmask[None, :], other=0.0,
        )  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
        k0 += TILE_K
    base = split * num_rows + rows64
    tl.store(part_ptr + base[:, None] * N_PAD + outs[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + base, sq, mask=rmask)


@triton.jit
def _sum_splits(part_ptr, t, num_rows, num_splits, cols, cmask, SPLITS_P: tl.constexpr,
                N_PAD: tl.constexpr):  # fmt: skip
    """Sum over splits of ``part[:, t, cols]`` for a ``[A, B]`` column index block ``cols``."""
    sp = tl.arange(0, SPLITS_P)
    ptrs = part_ptr + ((sp[:, None, None] * num_rows + t) * N_PAD + cols[None, :, :])
    vals = tl.load(ptrs, mask=(sp < num_splits)[:, None, None] & cmask[None, :, :], other=0.0)
    return tl.sum(vals, axis=0)


@triton.jit
def hc_pre_kernel(
    part_ptr, sq_ptr, base_ptr, scale_ptr, s_ptr, x_ptr, post_ptr, comb_ptr,
    num_rows, hidden, num_splits, inv_k, eps, hc_eps, iters,
    N: tl.constexpr, N_P: tl.constexpr, N_PAD: tl.constexpr, SPLITS_P: tl.constexpr,
    TILE_H: tl.constexpr, HEAD: tl.constexpr,
):  # fmt: skip
    """The mixing weights of token ``t`` from its partials, and its block input tile."""
    t = tl.program_id(0)
    h_tile = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    sq = tl.sum(tl.load(sq_ptr + sp * num_rows + t, mask=sp < num_splits, other=0.0), axis=0)
    rrms = tl.math.rsqrt(sq * inv_k + eps)
    i = tl.arange(0, N_P)
    imask = i < N
    j = tl.arange(0, N_P)
    jmask = j < N
    # pre (a [N_P, 1] column block: _sum_splits takes 2-D column indices)
    pre_f = tl.sum(_sum_splits(part_ptr, t, num_rows, num_splits, i[:, None], imask[:, None],
                               SPLITS_P, N_PAD), axis=1) * rrms  # fmt: skip
    pre_b = tl.load(base_ptr + i, mask=imask, other=0.0)
    pre = tl.sigmoid(pre_f * tl.load(scale_ptr) + pre_b) + hc_eps
    pre = tl.where(imask, pre, 0.0)
    # block input: x = sum_i pre[i] * s[t, i]
    hs = h_tile * TILE_H + tl.arange(0, TILE_H)
    hmask = hs < hidden
    t64 = t.to(tl.int64)
    s = tl.load(
        s_ptr + (t64 * N + i[:, None]) * hidden + hs[None, :],
        mask=imask[:, None] & hmask[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    x = tl.sum(pre[:, None] * s, axis=0)
    tl.store(x_ptr + t64 * hidden + hs, x.to(x_ptr.dtype.element_ty), mask=hmask)
    if not HEAD:  # noqa: SIM102 (constexpr, then a runtime branch)
        if h_tile == 0:
            post_f = tl.sum(_sum_splits(part_ptr, t, num_rows, num_splits, N + i[:, None],
                                        imask[:, None], SPLITS_P, N_PAD), axis=1) * rrms  # fmt: skip
            post_b = tl.load(base_ptr + N + i, mask=imask, other=0.0)
            post = 2 * tl.sigmoid(post_f * tl.load(scale_ptr + 1) + post_b)
            tl.store(post_ptr + t64 * N + i, post, mask=imask)
            cidx = i[:, None] * N + j[None, :]  # [N_P, N_P]
            cmask = imask[:, None] & jmask[None, :]
            comb_f = _sum_splits(part_ptr, t, num_rows, num_splits, 2 * N + cidx, cmask,
                                 SPLITS_P, N_PAD) * rrms  # fmt: skip
            comb_b = tl.load(base_ptr + 2 * N + cidx, mask=cmask, other=0.0)
            logits = comb_f * tl.load(scale_ptr + 2) + comb_b
            logits = tl.where(cmask, logits, float("-inf"))
            row_max = tl.max(logits, axis=1)
            row_max = tl.where(imask, row_max, 0.0)
            e = tl.where(cmask, tl.exp(logits - row_max[:, None]), 0.0)
            den = tl.sum(e, axis=1)
            den = tl.where(imask, den, 1.0)
            comb = tl.where(cmask, e / den[:, None] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            it = 1
            while it < iters:
                comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
                it += 1
            tl.store(comb_ptr + t64 * N * N + cidx, comb, mask=cmask)


@triton.jit
def hc_post_kernel(
    s_ptr, out_ptr, post_ptr, comb_ptr, res_ptr, hidden,
    N: tl.constexpr, N_P: tl.constexpr, TILE_H: tl.constexpr,
):  # fmt: skip
    """``res[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * s[t, j]`` (torch's roundings)."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    hmask = hs < hidden
    dtype: tl.constexpr = res_ptr.dtype.element_ty
    k = tl.arange(0, N_P)
    kmask = k < N
    post = _round(tl.load(post_ptr + t * N + k, mask=kmask, other=0.0), dtype)
    out = tl.load(out_ptr + t * hidden + hs, mask=hmask, other=0.0).to(tl.float32)
    term = _round(post[:, None] * out[None, :], dtype)  # [N_P, TILE_H]
    acc = tl.zeros([N_P, TILE_H], dtype=tl.float32)
    for jj in tl.static_range(N):
        c = _round(tl.load(comb_ptr + (t * N + jj) * N + k, mask=kmask, other=0.0), dtype)
        sj = tl.load(s_ptr + (t * N + jj) * hidden + hs, mask=hmask, other=0.0).to(tl.float32)
        acc += c[:, None] * sj[None, :]
    res = term + _round(acc, dtype)
    mask = kmask[:, None] & hmask[None, :]
    tl.store(res_ptr + (t * N + k[:, None]) * hidden + hs[None, :], res.to(dtype), mask=mask)
