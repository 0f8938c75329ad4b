"""A decode step's dense MoE in two Triton kernels that each read their weights once.

In a decode step (a few dozen token rows, every expert routed to) DeepSeek-V4's fused dense
path (`kvplan.models.deepseek_v4.moe.DeepseekV4MoE`) reads two fused weights: ``x_weight
[(E + 1) * 2I + E, H]`` (every routed expert's gate / up rows, the shared expert's as expert
``E``, then the router's ``E`` rows) and ``down_weight [E + 1, H, I]``. On cuBLAS that is five
launches: one GEMM, the routing kernel, a SwiGLU kernel, a batched GEMM, the weighted sum. Here
the SwiGLU rides in the first GEMM's epilogue and the weighted sum in the second's:

- `moe_gate_up_swiglu` (``moe_gate_up_kernel``): the weight is tiled, not the rows ("swap AB",
  as `kvplan.ops.small_gemm`): program ``p < (E + 1) * cdiv(I, BLOCK_N)`` multiplies
  ``BLOCK_N`` gate rows of one expert and the matching up rows by every token row over the
  whole ``H``, rounds both products to ``x``'s dtype (as the GEMM's output is rounded) and
  writes their SwiGLU (`kvplan.ops._moe_kernels.swiglu_values`, the SwiGLU kernel's own
  code) to ``h [E + 1, T, I]``; the last programs write the router logits ``[T, E]``.
- `moe_down_sum` (``moe_down_sum_kernel``): program ``j`` owns ``BLOCK_N`` output columns and
  runs one pipelined loop over (expert, K step); at each expert's last K step its product is
  rounded to the dtype (as the batched GEMM's output is), weighted by ``dense[t, e]`` and added
  to an fp32 sum in expert order; the shared expert (slice ``E``) is added after the sum is
  rounded -- `kvplan.ops.moe_dense.expert_weighted_sum`'s operations, launched without fp
  contraction as its kernel is.

So the two kernels compute what the five do, up to the GEMMs' summation order over ``H`` and
``I``. Where they run (`moe_decode_wanted`): CUDA (or ``KVPLAN_FORCE_TRITON=1``) bf16 / fp16
``x`` of at most ``MAX_ROWS`` rows, ``KVPLAN_MOE_DECODE`` not 0. The torch path (CPU, the
reference) composes ``F.linear``, `moe_swiglu`, ``torch.bmm`` and `expert_weighted_sum`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import env_flag, triton_interpreting, use_triton
from kvplan.ops._launch import jit
from kvplan.ops._moe_kernels import swiglu_values
from kvplan.ops._triton_util import round_to as _round
from kvplan.ops.moe_dense import expert_weighted_sum, moe_swiglu

__all__ = [
    "MAX_ROWS",
    "MoeDecodePlan",
    "moe_decode_wanted",
    "moe_down_sum",
    "moe_gate_up_swiglu",
]

MAX_ROWS = 64  # token rows: one tensor-core tile of them
ENABLED = env_flag("KVPLAN_MOE_DECODE", True)  # read at import; 0 keeps cuBLAS (A/B runs)
_HALF = (torch.bfloat16, torch.float16)


class MoeDecodePlan(NamedTuple):
    """Launch shape of one of the two kernels."""

    block_n: int  # weight rows a program (gate rows, and as many up rows, in the first)
    block_k: int
    num_warps: int
    num_stages: int


# sm_90 (ptxas, no GPU): 64 x 64 at 4 warps keeps the gate-up kernel's 255 registers without
# spills (64 x 128 spills 492 bytes); 16 x 256 gives the down kernel 168 registers
GATE_UP_PLAN = MoeDecodePlan(64, 64, 4, 4)
DOWN_PLAN = MoeDecodePlan(16, 256, 4, 4)


@jit
def _dot(w, x, acc, UPCAST: tl.constexpr):
    """``acc + w @ x^T``; ``UPCAST`` widens the operands to fp32 (the CPU interpreter)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@jit(sizes=("num_rows",))
def moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, logits_ptr, num_rows, hidden, inter, num_router, limit, stride_x,
    n_tiles, n_swiglu,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Programs ``< n_swiglu``: ``h[e, t, i]`` for one expert ``e`` and ``BLOCK_N`` columns
    ``i``; the others: ``BLOCK_N`` columns of the router logits ``[T, num_router]``."""
    pid = tl.program_id(0)
    dtype: tl.constexpr = h_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    if pid < n_swiglu:
        ex = pid // n_tiles
        cols = (pid % n_tiles) * BLOCK_N + offs_n
        c_ok = cols < inter
        g_rows = (ex * 2 * inter + cols).to(tl.int64)
        g_ptrs = w_ptr + g_rows[:, None] * hidden + offs_k[None, :]
        u_ptrs = g_ptrs + inter * hidden
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(K_STEPS):  # a static trip count: software-pipelined (num_stages)
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=c_ok[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=c_ok[:, None], other=0.0)
            else:
                k_ok = (i * BLOCK_K + offs_k) < hidden
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = _dot(wg, x, acc_g, UPCAST)
            acc_u = _dot(wu, x, acc_u, UPCAST)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = swiglu_values(_round(acc_g, dtype), _round(acc_u, dtype), limit, dtype)
        h_ptrs = h_ptr + (ex * num_rows + offs_m[None, :]).to(tl.int64) * inter + cols[:, None]
        tl.store(h_ptrs, h, mask=c_ok[:, None] & m_ok[None, :])
    else:
        cols = (pid - n_swiglu) * BLOCK_N + offs_n
        c_ok = cols < num_router
        rows = (2 * inter * (n_swiglu // n_tiles) + cols).to(tl.int64)  # after every gate/up
        w_ptrs = w_ptr + rows[:, None] * hidden + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(K_STEPS):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=c_ok[:, None], other=0.0)
            else:
                k_ok = (i * BLOCK_K + offs_k) < hidden
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(w, x, acc, UPCAST)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        l_ptrs = logits_ptr + offs_m[None, :].to(tl.int64) * num_router + cols[:, None]
        tl.store(l_ptrs, acc.to(dtype), mask=c_ok[:, None] & m_ok[None, :])


@jit(sizes=("num_rows",))
def moe_down_sum_kernel(
    h_ptr, w_ptr, dense_ptr, out_ptr, num_rows, hidden, inter,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``out[t, n] = round(round(sum_{e < E} dense[t, e] * round(y_e[t, n])) + round(y_E[t,
    n]))`` with ``y_e = h[e] @ down[e]^T``, for ``BLOCK_N`` columns ``n``; ``E =
    NUM_EXPERTS`` routed experts (a constexpr: one static, pipelined loop), slice ``E`` the
    shared one."""
    pid = tl.program_id(0)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < hidden
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_rows
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    shared = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w_rows = cols.to(tl.int64)[:, None] * inter + offs_k[None, :]
    h_rows = offs_m.to(tl.int64)[:, None] * inter + offs_k[None, :]
    for i in range((NUM_EXPERTS + 1) * K_STEPS):  # (expert, K step): one pipelined loop
        ex = i // K_STEPS
        step = i % K_STEPS
        k0 = step * BLOCK_K
        w_base = w_ptr + ex.to(tl.int64) * hidden * inter + k0
        h_base = h_ptr + ex.to(tl.int64) * num_rows * inter + k0
        if EVEN_K:
            w = tl.load(w_base + w_rows, mask=c_ok[:, None], other=0.0)
            x = tl.load(h_base + h_rows, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < inter
            w = tl.load(w_base + w_rows, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(h_base + h_rows, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(w, x, acc, UPCAST)
        last = step == K_STEPS - 1
        y = _round(acc, dtype)  # the batched GEMM's output, rounded to the dtype
        wt = tl.load(dense_ptr + offs_m * NUM_EXPERTS + ex, mask=m_ok & (ex < NUM_EXPERTS),
                     other=0.0)  # fmt: skip
        total = tl.where(last & (ex < NUM_EXPERTS), total + wt[None, :] * y, total)
        shared = tl.where(last & (ex == NUM_EXPERTS), y, shared)
        acc = tl.where(last, 0.0, acc)
    res = _round(total, dtype) + shared
    o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * hidden + cols[:, None]
    tl.store(o_ptrs, res.to(dtype), mask=c_ok[:, None] & m_ok[None, :])


def moe_decode_wanted(x: torch.Tensor) -> bool:
    """Whether `moe_gate_up_swiglu` / `moe_down_sum` take ``x [T, H]``'s batch to the Triton
    kernels: ``KVPLAN_MOE_DECODE`` not 0, a Triton device, bf16 / fp16, ``1 <= T <=
    MAX_ROWS``."""
    return (
        ENABLED
        and use_triton(x)
        and x.dim() == 2
        and x.dtype in _HALF
        and 1 <= x.shape[0] <= MAX_ROWS
    )


def _block_m(t: int) -> int:
    return max(16, triton.next_power_of_2(t))


def _check_gate_up(x, x_weight, num_experts, inter) -> int:
    check_tensor("x", x, dtype=_HALF + (torch.float32,), ndim=2)
    check_tensor("x_weight", x_weight, dtype=x.dtype, ndim=2, device=x.device)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(inter, bool) or not isinstance(inter, int) or inter < 1:
        raise ValueError(f"inter must be a positive int, got {inter!r}")
    rows, hidden = x_weight.shape
    router = rows - (num_experts + 1) * 2 * inter
    if router < 1:
        raise ValueError(
            f"x_weight has {rows} rows: fewer than (num_experts + 1) * 2 * inter + 1 = "
            f"{(num_experts + 1) * 2 * inter + 1}"
        )
    if x.shape[1] != hidden:
        raise ValueError(f"x.shape[1]={x.shape[1]} differs from x_weight.shape[1]={hidden}")
    if x.stride(1) != 1 or x_weight.stride(1) != 1 or x_weight.stride(0) != hidden:
        raise ValueError("x's rows and x_weight must be contiguous along H")
    return router


def moe_gate_up_swiglu(
    x: torch.Tensor, x_weight: torch.Tensor, num_experts: int, inter: int, limit: float,
    plan: MoeDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """SwiGLU of every expert's gate / up projection of ``x``, and the router logits.

    Args:
        x: ``[T, H]`` token rows (unit column stride).
        x_weight: ``[(E + 1) * 2I + R, H]``: expert ``e``'s gate rows ``[e * 2I, e * 2I + I)``
            and up rows after them, for the ``E`` routed experts and the shared one, then the
            ``R`` router rows (the fused weight of `DeepseekV4MoE.fuse_weights`).
        num_experts: ``E`` (routed); inter: ``I``; limit: the SwiGLU clamp.
        plan: launch shape of the Triton kernel (default `GATE_UP_PLAN`).

    Returns:
        ``(h [E + 1, T, I], logits [T, R])`` in ``x``'s dtype: `moe_swiglu` of ``x @
        x_weight[:(E + 1) * 2I]^T`` and ``x @ x_weight[(E + 1) * 2I:]^T``.
    """
    router = _check_gate_up(x, x_weight, num_experts, inter)
    if not moe_decode_wanted(x):
        out = F.linear(x, x_weight)
        split = (num_experts + 1) * 2 * inter
        return moe_swiglu(out[:, :split], num_experts + 1, limit), out[:, split:]
    t, hidden = x.shape
    plan = GATE_UP_PLAN if plan is None else plan
    h = torch.empty(num_experts + 1, t, inter, dtype=x.dtype, device=x.device)
    logits = torch.empty(t, router, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(inter, plan.block_n)
    n_swiglu = (num_experts + 1) * n_tiles
    grid = (n_swiglu + triton.cdiv(router, plan.block_n),)
    moe_gate_up_kernel[grid](
        x, x_weight, h, logits, t, hidden, inter, router, float(limit), x.stride(0),
        n_tiles, n_swiglu,
        BLOCK_M=_block_m(t), BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        K_STEPS=triton.cdiv(hidden, plan.block_k), EVEN_K=hidden % plan.block_k == 0,
        UPCAST=triton_interpreting(), num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return h, logits


def moe_down_sum(
    h: torch.Tensor, down_weight: torch.Tensor, dense: torch.Tensor,
    plan: MoeDecodePlan | None = None,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' down projections weighted by ``dense`` and summed, plus the shared
    expert's.

    Args:
        h: ``[E + 1, T, I]`` from `moe_gate_up_swiglu` (slice ``E``: the shared expert).
        down_weight: ``[E + 1, H, I]``.
        dense: fp32 ``[T, E]``: each row's summed routing weight per expert (`moe_route`).
        plan: launch shape of the Triton kernel (default `DOWN_PLAN`).

    Returns:
        ``[T, H]`` in ``h``'s dtype: ``expert_weighted_sum(y[:E], dense, add=y[E])`` with ``y =
        bmm(h, down_weight^T)``.
    """
    check_tensor("h", h, dtype=_HALF + (torch.float32,), ndim=3)
    e1, t, inter = h.shape
    check_tensor("down_weight", down_weight, dtype=h.dtype, ndim=3, device=h.device)
    if down_weight.shape[0] != e1 or down_weight.shape[2] != inter:
        raise ValueError(
            f"down_weight {tuple(down_weight.shape)} does not match h {tuple(h.shape)} "
            "([E + 1, H, I] for h [E + 1, T, I])"
        )
    if e1 < 2:
        raise ValueError(f"h has {e1} experts: at least one routed one and the shared one")
    check_tensor("dense", dense, dtype=torch.float32, shape=(t, e1 - 1), device=h.device)
    hidden = down_weight.shape[1]
    if not moe_decode_wanted(h[0]):
        y = torch.bmm(h, down_weight.transpose(1, 2))
        return expert_weighted_sum(y[:-1], dense, add=y[-1])
    plan = DOWN_PLAN if plan is None else plan
    h = h.contiguous()
    down_weight = down_weight.contiguous()
    dense = dense.contiguous()
    out = torch.empty(t, hidden, dtype=h.dtype, device=h.device)
    moe_down_sum_kernel[(triton.cdiv(hidden, plan.block_n),)](
        h, down_weight, dense, out, t, hidden, inter,
        NUM_EXPERTS=e1 - 1, BLOCK_M=_block_m(t), BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        K_STEPS=triton.cdiv(inter, plan.block_k), EVEN_K=inter % plan.block_k == 0,
        UPCAST=triton_interpreting(), num_warps=plan.num_warps, num_stages=plan.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
