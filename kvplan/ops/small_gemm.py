"""``x @ w.T`` for few rows: a weight-streaming GEMM for decode steps (Triton, CUDA).

A decode step multiplies a few dozen token rows by every weight matrix of the model, so its
GEMMs are reads of the weights: the step's floor is the weights' bytes over the memory
bandwidth. cuBLAS reaches that on wide matrices but not on some of the narrow ones a decode step
has (an H200 profile of llama-1b at 64 rows: the attention output projection at 33 % of its
weight bandwidth, the qkv projection at 43 %). `small_linear` tiles the weight instead of the
rows ("swap AB": each program owns ``BLOCK_N`` weight rows, all the token rows, one range of
K), so that enough programs stream the weight at once:

* grid ``(cdiv(N, BLOCK_N), S)``: program ``(j, s)`` computes the fp32 partial
  ``w[j-tile, K_s] @ x[:, K_s].T`` of its K range ``K_s`` on the tensor cores;
* ``S == 1``: it writes its tile of the output;
* ``S > 1`` ("split K"): it writes its partial to a workspace and counts itself in on the
  tile's counter (an atomic); the program that arrives last adds the tile's ``S`` partials in
  the order ``s = 0 .. S-1``, writes the output and resets the counter to zero for the next
  call. The sum's order never depends on which program finished when, so every run gives the
  same bits; one launch, no memset (the counters are left zeroed), CUDA-graph safe.

The plan (`small_gemm_plan`) picks ``S`` so that about ``PROGRAMS_PER_SM`` programs run per
SM; the tile shapes were chosen by `bench/bench_small_gemm.py`. `small_linear_torch` is the
reference (``F.linear``); CPU tensors run it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from kvplan.ops._dispatch import cuda_sm_count, triton_interpreting, use_triton

__all__ = [
    "SmallGemmPlan",
    "small_gemm_plan",
    "small_linear",
    "small_linear_torch",
    "small_linear_triton",
    "small_linear_wanted",
    "linear",
]

MAX_ROWS = 64  # token rows the kernel takes (one tensor-core tile of them)
BLOCK_N = 64  # weight rows a program
BLOCK_K = 128  # K a loop step
NUM_WARPS = 4
NUM_STAGES = 4
PROGRAMS_PER_SM = 2
_COUNTERS = 1 << 14  # tile counters kept per device (N / BLOCK_N tiles at most)
_counters: dict[torch.device, torch.Tensor] = {}


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
    k_per_split: int  # a multiple of block_k
    splits: int
    num_warps: int
    num_stages: int


@triton.jit
def small_linear_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    K_STEPS: tl.constexpr, EVEN_K: tl.constexpr,  # K steps a program; K % (K_STEPS * BLOCK_K) == 0
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k0 = pid_k * (K_STEPS * BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(K_STEPS):  # a static trip count: software-pipelined (num_stages)
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + i * BLOCK_K + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRET:  # the interpreter's dot misreads bf16: the same products in fp32
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    o_ok = n_ok[:, None] & m_ok[None, :]
    if SPLITS > 1:
        # this program's partial, then count in; the last of the tile's programs adds them all
        # in split order (the same bits whichever program is last)
        part = ws_ptr + (pid_k * BLOCK_M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=n_ok[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                p = ws_ptr + (s * BLOCK_M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
                total += tl.load(p, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def small_gemm_plan(
    m: int, n: int, k: int, sm_count: int, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
    programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES, splits: int | None = None,
) -> SmallGemmPlan:  # fmt: skip
    """Tiles for ``[m, k] @ [n, k].T``: K split until about ``programs_per_sm * sm_count``
    programs run (never below one ``block_k`` step a program); ``splits`` forces a count."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_gemm_plan: m={m} must be in [1, {MAX_ROWS}]")
    block_m = max(16, triton.next_power_of_2(m))
    k_steps = triton.cdiv(k, block_k)
    if splits is None:
        tiles = triton.cdiv(n, block_n)
        want = max(1, min(k_steps, (programs_per_sm * sm_count) // tiles))
        # the largest count up to that which divides the K steps evenly (no ragged split)
        splits = max(d for d in range(1, want + 1) if k_steps % d == 0)
    splits = max(1, min(splits, k_steps))
    k_per_split = triton.cdiv(k_steps, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    return SmallGemmPlan(block_m, block_n, block_k, k_per_split, splits, num_warps, num_stages)


def _counter_buffer(device: torch.device, tiles: int) -> torch.Tensor:
    buf = _counters.get(device)
    if buf is None:
        if tiles > _COUNTERS:
            raise ValueError(f"small_linear: {tiles} output tiles exceed {_COUNTERS}")
        buf = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


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


def small_linear_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference of `small_linear`: ``F.linear(x, weight)``."""
    _check(x, weight)
    return F.linear(x, weight)


def small_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, plan: SmallGemmPlan | None = None
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` -> ``[M, N]`` in ``x``'s dtype by `small_linear_kernel`
    (``M <= MAX_ROWS``; fp32 accumulation; the same bits on every run for one plan)."""
    _check(x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if plan is None:
        sms = 4 if triton_interpreting() else cuda_sm_count(x.device)
        plan = small_gemm_plan(m, n, k, sms)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(n, plan.block_n)
    split = plan.splits > 1
    if split:
        ws = torch.empty((plan.splits, plan.block_m, n), dtype=torch.float32, device=x.device)
        cnt = _counter_buffer(x.device, tiles)
    else:
        ws = cnt = out  # unused
    small_linear_kernel[(tiles, plan.splits)](
        x, weight, out, ws, cnt, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLITS=plan.splits,
        K_STEPS=plan.k_per_split // plan.block_k, INTERPRET=triton_interpreting(),
        EVEN_K=k % plan.k_per_split == 0, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out


def small_linear_wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` takes ``x`` / ``weight`` to the Triton kernel: CUDA bf16 / fp16
    inputs of at most ``MAX_ROWS`` rows with a contiguous K (``KVPLAN_SMALL_GEMM=1``)."""
    return (
        ENABLED
        and use_triton(x)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [..., K]``: the Triton kernel when
    `small_linear_wanted` says so, else ``F.linear``."""
    if x.dim() == 2 and small_linear_wanted(x, weight):
        return small_linear_triton(x, weight)
    return F.linear(x, weight)


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a plain bias-free ``nn.Linear`` through `small_linear` (the Triton
    kernel for few CUDA rows); subclasses (tensor-parallel layers) and biased layers run their
    own forward."""
    if type(module) is nn.Linear and module.bias is None and x.dim() == 2:
        return small_linear(x, module.weight)
    return module(x)
