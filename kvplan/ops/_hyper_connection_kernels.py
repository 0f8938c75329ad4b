"""Triton kernels of the manifold-constrained hyper-connections (launched by
`kvplan.ops.hyper_connection` and `kvplan.ops.hyper_connection_fused`).

A hyper-connection's weights come from ``f = RMSNorm(s.flatten) @ fn^T``; the norm is a per-row
scalar, so it is applied after the projection: ``f = (s @ fn^T) * rsqrt(mean(s^2) + eps)``.

- ``hc_proj_kernel``: grid ``(cdiv(T, TILE_T), num_splits)``; split-K partial projection of
  ``x [T, K]`` (``K = n * hidden``) on ``fn [N_OUT, K]`` (fp32, ``tl.dot`` in IEEE fp32) and
  partial sums of squares, written to ``part [num_splits, T, N_PAD]`` and ``sq [num_splits, T]``.
  Split ``p`` owns the hidden range ``[p * h_per_split, (p + 1) * h_per_split)`` of every stream;
  one K tile is ``TILE_H`` hidden columns of all ``n`` streams (``N_P * TILE_H`` columns).
  With ``FUSED`` the kernel first forms the tile of ``x = hc_post(s, post, comb, out)`` with
  `_post_mix` (the same code as ``hc_post_kernel``), stores it to ``x`` and reads it back
  through the same load as the unfused kernel, so both modes project the same values in the
  same order.
- ``hc_pre_kernel``: grid ``(T, cdiv(hidden, TILE_H) + (0 if HEAD else 1))``; adds the partials
  of one token and forms ``pre``; programs ``h < cdiv(hidden, TILE_H)`` write
  ``x = sum_i pre[i] * s[i]`` for their hidden tile, the last one (unless ``HEAD``) ``post`` and
  the Sinkhorn-normalised ``comb``.
- ``hc_post_kernel``: grid ``(T, cdiv(hidden, TILE_H))``; ``s'`` by `_post_mix`.
- Row-tiled forms (prefill sizes): ``hc_pre_kernel`` with ``WEIGHTS_ONLY`` (grid ``(T, 1)``,
  the per-token weights by the same code, ``pre`` written out), then ``hc_pre_rows_kernel``
  for ``x``; ``hc_post_rows_kernel`` for ``s'``. Grids ``(cdiv(T, TILE_T), cdiv(hidden,
  TILE_H))``; every element takes the one-token kernels' operations in their order, so the
  results are the same bits.

The block output ``out`` may come as ``OUT_SPLITS`` fp32 split-K partials (a
`kvplan.ops.split_linear.SplitSums`): `_block_out` adds them in order and rounds the sum to
``s``'s dtype, as ``SplitSums.total`` does, so ``s'`` has the bits of the summed output.

`_post_mix` uses explicit ``fma`` where a product meets a sum, so its result does not depend on
the compiler's contraction setting: ``mixed = fma(c[N-1], s[N-1], ... fma(c[1], s[1],
c[0] * s[0]))`` with ``c = round(comb[:, k])``, then ``s' = round(post) * out + round(mixed)``
with the product rounded to ``s``'s dtype first (bf16 / fp16), or ``fma(post, out, mixed)``
(fp32). For bf16 / fp16 every product is exact in fp32, so this is torch's rounding.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._triton_util import round_to as _round
from kvplan.ops.rms_norm import weighted_rms_norm


@jit
def _block_out(out_ptr, offs, mask, split_stride, OUT_SPLITS: tl.constexpr,
               dtype: tl.constexpr):  # fmt: skip
    """The block output at ``offs`` as fp32: ``out`` itself (``OUT_SPLITS == 0``), or the sum
    of ``OUT_SPLITS`` fp32 partials ``split_stride`` apart, added in order from the first and
    rounded to ``dtype`` (`kvplan.ops.split_linear.SplitSums.total`)."""
    if OUT_SPLITS == 0:
        return tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, OUT_SPLITS):
        acc += tl.load(out_ptr + i * split_stride + offs, mask=mask, other=0.0)
    return _round(acc, dtype)


@jit
def _post_mix(s_ptr, out_ptr, post_ptr, comb_ptr, t, k, h, mask, hidden, split_stride,
              N: tl.constexpr, OUT_SPLITS: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """``s'[t, k, h]`` (fp32 holding a ``dtype`` value) for broadcastable int64 token ``t``,
    stream ``k`` and hidden ``h`` index tensors; ``mask`` (the full shape: every load takes
    its shape, so the ``fma`` operands agree) covers the valid elements; the block output
    ``out`` as `_block_out` reads it."""
    post = _round(tl.load(post_ptr + t * N + k, mask=mask, other=0.0), dtype)
    out = _block_out(out_ptr, t * hidden + h, mask, split_stride, OUT_SPLITS, dtype)
    for jj in tl.static_range(N):
        c = _round(tl.load(comb_ptr + (t * N + jj) * N + k, mask=mask, other=0.0), dtype)
        sj = tl.load(s_ptr + (t * N + jj) * hidden + h, mask=mask, other=0.0).to(tl.float32)
        if jj == 0:
            mixed = c * sj
        else:
            mixed = tl.fma(c, sj, mixed)
    if dtype == tl.float32:
        res = tl.fma(post, out, mixed)
    else:
        res = _round(post * out, dtype) + _round(mixed, dtype)
    return _round(res, dtype)


@jit(sizes=("num_rows",))
def hc_proj_kernel(
    s_ptr, out_ptr, post_ptr, comb_ptr, x_ptr, fn_ptr, part_ptr, sq_ptr,
    num_rows, hidden, h_per_split, n_out, out_split_stride,
    N: tl.constexpr, N_P: tl.constexpr, TILE_T: tl.constexpr, TILE_H: tl.constexpr,
    N_PAD: tl.constexpr, FUSED: tl.constexpr, TC: tl.constexpr, OUT_SPLITS: tl.constexpr,
    FN_FIRST: tl.constexpr = False,
):  # fmt: skip
    """``part[p, t, o] = sum_{k in split p} x[t, k] * fn[o, k]``; ``sq[p, t] = sum x[t, k]^2``;
    with ``FUSED``, ``x`` is first written as ``hc_post(s, post, comb, out)``. ``TC`` (bf16
    ``x``): tensor-core dots of ``x`` with ``fn`` split into three bf16 parts
    (``fn = w1 + w2 + w3`` to fp32 precision; every product exact in the fp32 accumulators).
    ``FN_FIRST``: each K tile's ``fn`` load is issued first (with ``FUSED``: before the
    barrier and the read back; the same values)."""
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * TILE_T + tl.arange(0, TILE_T)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    outs = tl.arange(0, N_PAD)
    omask = outs < n_out
    cols = tl.arange(0, N_P * TILE_H)
    streams = cols // TILE_H  # [C] stream of each tile column
    k_total = N * hidden
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([TILE_T, N_PAD], dtype=tl.float32)
    acc_lo = tl.zeros([TILE_T, N_PAD], dtype=tl.float32)  # TC: the w2 + w3 products
    sq = tl.zeros([TILE_T], dtype=tl.float32)
    h_lo = split * h_per_split
    h0 = 0  # while loops: the CPU interpreter takes no runtime ``range`` bound
    while h0 < h_per_split:
        hs = h_lo + h0 + cols % TILE_H  # [C]
        cmask = (streams < N) & (hs < hidden) & (hs < h_lo + h_per_split)
        ks = streams * hidden + hs
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows64[:, None] * k_total + ks[None, :]
        w_ptrs = fn_ptr + outs[:, None] * k_total + ks[None, :]
        w_mask = omask[:, None] & cmask[None, :]
        if FN_FIRST:  # issued beside the mix's loads, ahead of the barrier
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FUSED:
            v = _post_mix(s_ptr, out_ptr, post_ptr, comb_ptr, rows64[:, None],
                          streams[None, :], hs[None, :], m2, hidden, out_split_stride, N,
                          OUT_SPLITS, dtype)  # fmt: skip
            tl.store(x_ptr + offs, v.to(dtype), mask=m2)
            tl.debug_barrier()  # the tile is read back below by other threads of the program
        x = tl.load(x_ptr + offs, mask=m2, other=0.0)
        if not FN_FIRST:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if TC:
            w1 = w.to(tl.bfloat16)
            r = w - w1.to(tl.float32)
            w2 = r.to(tl.bfloat16)
            w3 = (r - w2.to(tl.float32)).to(tl.bfloat16)
            acc_lo = tl.dot(x, tl.trans(w3), acc_lo)
            acc_lo = tl.dot(x, tl.trans(w2), acc_lo)
            acc = tl.dot(x, tl.trans(w1), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        h0 += TILE_H
    if TC:
        acc += acc_lo
    base = split * num_rows + rows64
    tl.store(part_ptr + base[:, None] * N_PAD + outs[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + base, sq, mask=rmask)


@jit
def _sum_splits(part_ptr, t, num_rows, num_splits, cols, cmask, SPLITS_P: tl.constexpr,
                N_PAD: tl.constexpr):  # fmt: skip
    """Sum over splits of ``part[:, t, cols]`` for a ``[A, B]`` column index block ``cols``."""
    sp = tl.arange(0, SPLITS_P)
    ptrs = part_ptr + ((sp[:, None, None] * num_rows + t) * N_PAD + cols[None, :, :])
    vals = tl.load(ptrs, mask=(sp < num_splits)[:, None, None] & cmask[None, :, :], other=0.0)
    return tl.sum(vals, axis=0)


@jit
def _pre_weights(part_ptr, base_ptr, scale_ptr, t, num_rows, num_splits, rrms, i, imask, hc_eps,
                 N_P: tl.constexpr, SPLITS_P: tl.constexpr, N_PAD: tl.constexpr):  # fmt: skip
    """``pre [N_P]`` of token ``t`` (0 past ``N``) from its partials (a ``[N_P, 1]`` column
    block: `_sum_splits` takes 2-D column indices)."""
    pre_f = tl.sum(_sum_splits(part_ptr, t, num_rows, num_splits, i[:, None], imask[:, None],
                               SPLITS_P, N_PAD), axis=1) * rrms  # fmt: skip
    pre_b = tl.load(base_ptr + i, mask=imask, other=0.0)
    pre = tl.sigmoid(tl.fma(pre_f, tl.load(scale_ptr), pre_b)) + hc_eps
    return tl.where(imask, pre, 0.0)


@jit
def _stream_step(x, p, s, k: tl.constexpr):
    """Stream ``k``'s term of ``x = sum_k pre[k] * s[k]``: ``p * s`` for the first stream, then
    one explicit fma per stream in stream order (padded streams add ``0 * 0``). Both hc_pre
    forms take this sequence, so they agree bit for bit on any layout and with or without the
    compiler's fp contraction (a reduction over the stream axis would sum in a
    layout-dependent order)."""
    if k == 0:
        return p * s
    return tl.fma(p, s, x)


@jit(sizes=("num_rows", "num_splits", "iters"))
def hc_pre_kernel(
    part_ptr, sq_ptr, base_ptr, scale_ptr, s_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr,
    norm_ptr, num_rows, hidden, num_splits, inv_k, eps, hc_eps, iters, inv_hidden, norm_eps,
    N: tl.constexpr, N_P: tl.constexpr, N_PAD: tl.constexpr, SPLITS_P: tl.constexpr,
    TILE_H: tl.constexpr, HEAD: tl.constexpr, WEIGHTS_ONLY: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """The mixing weights of token ``t`` from its partials, and its block input tile. With
    ``WEIGHTS_ONLY`` (grid ``(T, 1)``) the one program of a token writes ``pre [T, N]`` (and,
    unless ``HEAD``, ``post`` and ``comb``) and no ``x``: `hc_pre_rows_kernel` forms ``x``.
    With ``NORM`` (one hidden tile holds the whole row) the program writes
    ``weighted_rms_norm(x)`` with the fp32 weights at ``norm_ptr`` instead of ``x``. Launched
    without fp contraction: every multiply-add that should fuse is an explicit ``fma``."""
    t = tl.program_id(0)
    h_tile = tl.program_id(1)
    t64 = t.to(tl.int64)
    sp = tl.arange(0, SPLITS_P)
    sq = tl.sum(tl.load(sq_ptr + sp * num_rows + t, mask=sp < num_splits, other=0.0), axis=0)
    rrms = tl.math.rsqrt(tl.fma(sq, inv_k, eps))
    i = tl.arange(0, N_P)
    imask = i < N
    j = tl.arange(0, N_P)
    jmask = j < N
    if h_tile * TILE_H < hidden and not WEIGHTS_ONLY:
        pre = _pre_weights(part_ptr, base_ptr, scale_ptr, t, num_rows, num_splits, rrms, i,
                           imask, hc_eps, N_P, SPLITS_P, N_PAD)  # fmt: skip
        # block input: x = sum_i pre[i] * s[t, i], in `_stream_step`'s order
        hs = h_tile * TILE_H + tl.arange(0, TILE_H)
        hmask = hs < hidden
        x = tl.zeros([TILE_H], dtype=tl.float32)
        for k in tl.static_range(N_P):
            p = tl.sum(tl.where(i == k, pre, 0.0), axis=0)  # pre[k], exactly
            sk = tl.load(s_ptr + (t64 * N + k) * hidden + hs, mask=hmask & (k < N), other=0.0)
            x = _stream_step(x, p, sk.to(tl.float32), k)
        x = x.to(x_ptr.dtype.element_ty)
        if NORM:  # the block's RMSNorm of the rounded row, as rms_norm_fp32w computes it
            w = tl.load(norm_ptr + hs, mask=hmask, other=0.0)
            x = weighted_rms_norm(x.to(tl.float32), w, inv_hidden, norm_eps)
        tl.store(x_ptr + t64 * hidden + hs, x.to(x_ptr.dtype.element_ty), mask=hmask)
    else:  # the extra program of the token (WEIGHTS_ONLY: its only one)
        if WEIGHTS_ONLY:  # the same code as above: the same pre
            pre = _pre_weights(part_ptr, base_ptr, scale_ptr, t, num_rows, num_splits, rrms,
                               i, imask, hc_eps, N_P, SPLITS_P, N_PAD)  # fmt: skip
            tl.store(pre_ptr + t64 * N + i, pre, mask=imask)
        if not HEAD:  # post and comb
            post_f = tl.sum(_sum_splits(part_ptr, t, num_rows, num_splits, N + i[:, None],
                                        imask[:, None], SPLITS_P, N_PAD), axis=1) * rrms  # fmt: skip
            post_b = tl.load(base_ptr + N + i, mask=imask, other=0.0)
            post = 2 * tl.sigmoid(tl.fma(post_f, tl.load(scale_ptr + 1), post_b))
            tl.store(post_ptr + t64 * N + i, post, mask=imask)
            cidx = i[:, None] * N + j[None, :]  # [N_P, N_P]
            cmask = imask[:, None] & jmask[None, :]
            comb_f = _sum_splits(part_ptr, t, num_rows, num_splits, 2 * N + cidx, cmask,
                                 SPLITS_P, N_PAD) * rrms  # fmt: skip
            comb_b = tl.load(base_ptr + 2 * N + cidx, mask=cmask, other=0.0)
            logits = tl.fma(comb_f, tl.load(scale_ptr + 2), comb_b)
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


@jit
def hc_post_kernel(
    s_ptr, out_ptr, post_ptr, comb_ptr, res_ptr, hidden, out_split_stride,
    N: tl.constexpr, N_P: tl.constexpr, TILE_H: tl.constexpr, OUT_SPLITS: tl.constexpr,
):  # fmt: skip
    """``res[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * s[t, j]`` (`_post_mix`;
    ``out`` as `_block_out` reads it)."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    k = tl.arange(0, N_P)
    mask = (k < N)[:, None] & (hs < hidden)[None, :]
    dtype: tl.constexpr = res_ptr.dtype.element_ty
    res = _post_mix(s_ptr, out_ptr, post_ptr, comb_ptr, t, k[:, None], hs[None, :], mask,
                    hidden, out_split_stride, N, OUT_SPLITS, dtype)  # fmt: skip
    tl.store(res_ptr + (t * N + k[:, None]) * hidden + hs[None, :], res.to(dtype), mask=mask)


@jit(sizes=("num_rows",))
def hc_pre_rows_kernel(
    pre_ptr, s_ptr, x_ptr, num_rows, hidden,
    N: tl.constexpr, N_P: tl.constexpr, TILE_T: tl.constexpr, TILE_H: tl.constexpr,
):  # fmt: skip
    """``x[t] = sum_i pre[t, i] * s[t, i]`` for ``TILE_T`` rows and ``TILE_H`` hidden columns
    (grid ``(cdiv(T, TILE_T), cdiv(hidden, TILE_H))``), ``pre`` fp32 ``[T, N]`` from
    ``hc_pre_kernel``'s ``WEIGHTS_ONLY`` form. The streams are added as ``hc_pre_kernel``
    adds them (`_stream_step`), so ``x`` has its bits whatever the layouts."""
    rows = tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    hs = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    m2 = rmask[:, None] & (hs < hidden)[None, :]
    x = tl.zeros([TILE_T, TILE_H], dtype=tl.float32)
    for i in tl.static_range(N_P):
        p = tl.load(pre_ptr + rows64 * N + i, mask=rmask & (i < N), other=0.0)
        s = tl.load(s_ptr + (rows64[:, None] * N + i) * hidden + hs[None, :],
                    mask=m2 & (i < N), other=0.0).to(tl.float32)  # fmt: skip
        x = _stream_step(x, tl.broadcast_to(p[:, None], [TILE_T, TILE_H]), s, i)
    tl.store(x_ptr + rows64[:, None] * hidden + hs[None, :], x.to(x_ptr.dtype.element_ty),
             mask=m2)  # fmt: skip


@jit(sizes=("num_rows",))
def hc_post_rows_kernel(
    s_ptr, out_ptr, post_ptr, comb_ptr, res_ptr, num_rows, hidden,
    N: tl.constexpr, N_P: tl.constexpr, TILE_T: tl.constexpr, TILE_H: tl.constexpr,
):  # fmt: skip
    """`hc_post_kernel` for ``TILE_T`` rows and ``TILE_H`` hidden columns of all streams (grid
    ``(cdiv(T, TILE_T), cdiv(hidden, TILE_H))``): `_post_mix`'s element operations, with each
    ``s`` / ``out`` tile and each row's ``post`` / ``comb`` loaded once and broadcast."""
    rows = tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)
    rows64 = rows.to(tl.int64)[:, None, None]  # [TILE_T, 1, 1]
    rmask = (rows < num_rows)[:, None, None]
    k = tl.arange(0, N_P)[None, :, None]  # [1, N_P, 1]
    kmask = rmask & (k < N)
    hs = (tl.program_id(1) * TILE_H + tl.arange(0, TILE_H))[None, None, :]  # [1, 1, TILE_H]
    hmask = rmask & (hs < hidden)
    mask = kmask & (hs < hidden)  # [TILE_T, N_P, TILE_H]
    dtype: tl.constexpr = res_ptr.dtype.element_ty
    shape: tl.constexpr = [TILE_T, N_P, TILE_H]
    post = _round(tl.load(post_ptr + rows64 * N + k, mask=kmask, other=0.0), dtype)
    out = tl.load(out_ptr + rows64 * hidden + hs, mask=hmask, other=0.0).to(tl.float32)
    for jj in tl.static_range(N):
        c = _round(tl.load(comb_ptr + (rows64 * N + jj) * N + k, mask=kmask, other=0.0), dtype)
        sj = tl.load(s_ptr + (rows64 * N + jj) * hidden + hs, mask=hmask, other=0.0)
        c = tl.broadcast_to(c, shape)
        sj = tl.broadcast_to(sj.to(tl.float32), shape)
        if jj == 0:
            mixed = c * sj
        else:
            mixed = tl.fma(c, sj, mixed)
    post = tl.broadcast_to(post, shape)
    out = tl.broadcast_to(out, shape)
    if dtype == tl.float32:
        res = tl.fma(post, out, mixed)
    else:
        res = _round(post * out, dtype) + _round(mixed, dtype)
    res = _round(res, dtype)
    tl.store(res_ptr + (rows64 * N + k) * hidden + hs, res.to(dtype), mask=mask)
