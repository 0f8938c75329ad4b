"""``x @ w.T`` for a few rows and a wide weight: the LM head of a decode step (Triton, CUDA).

A decode step multiplies a few dozen token rows by every weight matrix of the model, so its
GEMMs are reads of the weights. `small_linear_kernel` tiles the weight instead of the rows
("swap AB"): program ``j`` multiplies ``BLOCK_N`` weight rows by all the token rows over the
whole K on the tensor cores, one fp32 accumulator, the output tile written once.

Where it runs (`small_linear_wanted`): at most ``MAX_ROWS`` rows and a weight of at least
``MIN_N`` rows and ``MIN_WEIGHT`` elements, i.e. the vocabulary projections of the larger
models. Measured on the H200 (`bench/bench_small_gemm.py`: weights streamed past the L2
cache, CUDA graphs, 2026-12-03, session 18 call C), these tiles against cuBLAS: LM head
64 x 128,256 x 2,048 143.0 vs 149.7 us, 32 x 129,280 x 2,048 140.0 vs 141.8, Gemma-3's
64 x 262,144 x 640 110.6 vs 113.7; but SmolLM2's 64 x 49,152 x 576 23.1 vs 20.0 (hence
``MIN_WEIGHT``). Inside the llama-1b decode graph (`bench/profile_engine.py`, calls C / D) the
LM head took 136.6 us (128 x 128 tiles) against cuBLAS's 142.3. On the narrow decode GEMMs
(2-33 MB of weights) cuBLAS was as fast or faster (64 x 2,048 x 2,048: 6.3 us, this kernel
7.7 at best; splitting K over more programs made it slower still; call B), so they stay on
cuBLAS. Everything else (CPU tensors included) runs ``F.linear``, the reference.

Greedy argmax (``argmax_out``): the kernel also folds its output tile into each token row's
best ``(order key, column)`` of the tile's ``BLOCK_N`` columns -- keyed on the value rounded to
the output dtype, as `kvplan.ops.argmax` keys the stored logits -- into int32 ``[M, n_tiles]``
buffers, and `kvplan.ops.argmax.argmax_merge` turns them into the tokens; the logits are not
read back. Off the kernel's path, `kvplan.ops.argmax.argmax_rows` of the logits fills it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.argmax import (
    _INT32_MIN,
    _order_keys,
    argmax_merge,
    argmax_rows,
    check_argmax_out,
)

__all__ = [
    "SmallGemmPlan",
    "small_gemm_plan",
    "small_linear",
    "small_linear_triton",
    "small_linear_wanted",
]

MAX_ROWS = 64  # token rows the kernel takes (one tensor-core tile of them)
MIN_N = 32768  # weight rows and elements below which cuBLAS measured as fast or faster
MIN_WEIGHT = 1 << 27
# tiles: 128 weight rows x 128 K a step, 4 stages, 4 warps: no spills on sm_90, and what ran
# in the decode graph above. At 64 x 128,256 x 2,048 (`bench_small_gemm.py`, H200, call C):
# 143.0 us; 128 x 64 with 6 stages 140.2 (Gemma-3's head 100.7 vs 110.6) but it spills 336
# bytes a thread and was not timed in an engine; 256 x 64 with 8 warps 141.2; 64 x 128 155.2.
BLOCK_N = 128
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4


def _enabled() -> bool:
    """``KVPLAN_SMALL_GEMM=0`` turns the kernel off (A/B runs); on by default."""
    text = os.environ.get("KVPLAN_SMALL_GEMM", "1")
    if text not in ("0", "1"):
        raise ValueError(f"KVPLAN_SMALL_GEMM must be 0 or 1, got {text!r}")
    return text == "1"


ENABLED = _enabled()


class SmallGemmPlan(NamedTuple):
    """Launch shape of `small_linear_kernel`."""

    block_m: int  # token rows padded to a power of two >= 16
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@jit
def small_linear_kernel(
    x_ptr, w_ptr, out_ptr, key_ptr, col_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, EVEN_K: tl.constexpr, ARGMAX: tl.constexpr,
):  # fmt: skip
    """``out [M, N] = x [M, K] @ w [N, K].T``, program ``j`` computing columns ``[j * BLOCK_N,
    (j + 1) * BLOCK_N)``. ``ARGMAX``: also ``key_ptr`` / ``col_ptr`` (int32 ``[M,
    num_tiles]``, ``num_tiles`` = programs) ``[m, j]`` = row ``m``'s best order key of the
    tile's stored values and the first column holding it (`kvplan.ops.argmax.argmax_merge`
    reads them); otherwise they are not touched."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(K_STEPS):  # a static trip count: software-pipelined (num_stages)
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (i * BLOCK_K + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = acc.to(out_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_M]
    if ARGMAX:  # keys of the rounded values: what an argmax of the stored logits reads
        # (before the store's pointers exist: the 64-bit pointer tile takes the registers)
        key = tl.where(n_ok[:, None], _order_keys(out), _INT32_MIN)
        top, first = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        at = offs_m * num_tiles + pid_n  # < MAX_ROWS * num_tiles: int32
        tl.store(key_ptr + at, top, mask=m_ok)
        tl.store(col_ptr + at, first + pid_n * BLOCK_N, mask=m_ok)
    o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(o_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])


def small_gemm_plan(
    m: int, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> SmallGemmPlan:  # fmt: skip
    """Tiles for ``[m, K] @ [N, K].T`` (``1 <= m <= MAX_ROWS``)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_gemm_plan: m={m} must be in [1, {MAX_ROWS}]")
    return SmallGemmPlan(
        max(16, triton.next_power_of_2(m)), block_n, block_k, num_warps, num_stages
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"small_linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"small_linear: x.shape[1]={x.shape[1]} differs from weight.shape[1]={weight.shape[1]}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"small_linear: x is {x.dtype}, weight {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"small_linear: the K dimension must be contiguous (x.stride={x.stride()}, "
            f"weight.stride={weight.stride()})"
        )


def _check_argmax_out(argmax_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_argmax_out(argmax_out, x.shape[0], x.device)
    if weight.shape[0] == 0:
        raise ValueError("argmax_out: a weight of 0 rows gives no column to pick")


def small_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, plan: SmallGemmPlan | None = None,
    argmax_out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ weight [N, K].T`` -> ``[M, N]`` in ``x``'s dtype by `small_linear_kernel`
    (``M <= MAX_ROWS``; fp32 accumulation over K in order); ``argmax_out`` as in
    `small_linear`, fused."""
    _check(x, weight)
    if argmax_out is not None:
        _check_argmax_out(argmax_out, x, weight)
    plan = small_gemm_plan(x.shape[0]) if plan is None else plan
    return _launch(x, weight, plan, argmax_out)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, plan: SmallGemmPlan,
    argmax_out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    num_tiles = triton.cdiv(n, plan.block_n)
    keys = cols = out  # not touched without ARGMAX
    if argmax_out is not None:
        keys, cols = torch.empty(2, m, num_tiles, dtype=torch.int32, device=x.device)
    small_linear_kernel[(num_tiles,)](
        x, weight, out, keys, cols, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        num_tiles,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        K_STEPS=triton.cdiv(k, plan.block_k), EVEN_K=k % plan.block_k == 0,
        ARGMAX=argmax_out is not None, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if argmax_out is not None:
        argmax_merge(keys, cols, argmax_out)
    return out


def small_linear_wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` takes ``x`` / ``weight`` to the Triton kernel: CUDA bf16 / fp16
    ``x [M, K]`` with ``1 <= M <= MAX_ROWS``, a weight of at least ``MIN_N`` rows and
    ``MIN_WEIGHT`` elements, contiguous K (and ``KVPLAN_SMALL_GEMM`` not 0)."""
    return (
        ENABLED
        and use_triton(x)
        and x.dim() == 2
        and weight.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and weight.shape[0] >= MIN_N
        and weight.numel() >= MIN_WEIGHT
        and x.shape[1] == weight.shape[1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, argmax_out: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias): the Triton kernel when `small_linear_wanted` says so,
    else ``F.linear``.

    Args:
        x: ``[M, K]`` (any leading shape on the ``F.linear`` path without ``argmax_out``).
        weight: ``[N, K]``, ``x``'s dtype.
        argmax_out: optional int64 ``[M]``, contiguous, on ``x``'s device: filled with
            ``logits.argmax(-1)`` of the returned logits (torch's rules: the first column of
            the largest value, NaN the largest, ``-0.0 == +0.0``) -- inside the kernel's
            epilogue on the Triton path (plus one small merge launch), by
            `kvplan.ops.argmax.argmax_rows` of the logits otherwise. TypeError / ValueError
            naming ``argmax_out`` when it is not such a tensor (or ``N == 0``).

    Returns:
        The logits ``[M, N]`` in ``x``'s dtype, bitwise the same with or without ``argmax_out``.

    >>> x, w = torch.randn(3, 8), torch.randn(50, 8)
    >>> tokens = torch.empty(3, dtype=torch.int64)
    >>> logits = small_linear(x, w, argmax_out=tokens)
    >>> torch.equal(tokens, logits.argmax(-1))
    True
    """
    if argmax_out is not None:
        if x.dim() != 2:
            raise ValueError(f"small_linear: argmax_out needs x [M, K], got {tuple(x.shape)}")
        _check_argmax_out(argmax_out, x, weight)
    if small_linear_wanted(x, weight):  # it checked what `_check` would
        return _launch(x, weight, small_gemm_plan(x.shape[0]), argmax_out)
    logits = F.linear(x, weight)
    if argmax_out is not None:
        argmax_rows(logits, out=argmax_out)
    return logits
