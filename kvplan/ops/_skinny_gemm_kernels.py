"""Triton kernels of `kvplan.ops.skinny_gemm`: ``y = x @ w^T`` for a few rows of ``x``.

``skinny_gemm_kernel``: grid ``(cdiv(N, BLOCK_N), splits)``. Program ``(n, s)`` multiplies all
``M`` rows (padded to ``M_P``, a dot's minimum of 16 or more) by ``BLOCK_N`` rows of ``w`` over
split ``s`` of the reduction: ``K_TILES`` tiles of ``BLOCK_K`` from ``s * K_TILES * BLOCK_K``
(a constexpr trip count, so the loads are software-pipelined over ``num_stages``). With one
split (``DIRECT``) it adds the bias and writes ``y`` in its dtype; else it writes the fp32
partial ``part[s]``, and ``skinny_reduce_kernel`` (grid ``(cdiv(M * N, BLOCK),)``) sums the
splits in split order, adds the bias and rounds once -- the same result on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, M_P)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    cols_in = tl.where(cmask, cols, 0).to(tl.int64)  # padding columns read row 0 (not stored)
    k_lo = split * (K_TILES * BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_ptrs = w_ptr + cols_in[:, None] * K
    acc = tl.zeros([M_P, BLOCK_N], dtype=tl.float32)
    for t in range(K_TILES):
        ks = k_lo + t * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:  # every split's tiles lie inside K
            x = tl.load(x_ptrs + ks[None, :], mask=rmask[:, None], other=0.0)
            w = tl.load(w_ptrs + ks[None, :])
        else:
            kmask = ks < K
            x = tl.load(x_ptrs + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs + ks[None, :], mask=kmask[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter's half-precision dot is unreliable: exact fp32 products
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    mask = rmask[:, None] & cmask[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        offs = (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def skinny_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    idx64 = idx.to(tl.int64)
    acc = tl.load(part_ptr + idx64, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + idx64, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx64, acc.to(out_ptr.dtype.element_ty), mask=mask)
