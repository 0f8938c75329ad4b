"""Ops of DeepSeek-V4's batched (dense) MoE path: routing, SwiGLU and the weighted expert sum.

The dense path runs every routed expert on every row, with a fixed number of kernels and no
host sync (CUDA-graph capturable)::

    logits  = x @ gate^T                                     # [T, E] (a GEMM, by the caller)
    ids, w, dense = moe_route(logits, ...)                   # [T, k], [T, k], fp32 [T, E]
    gu      = x @ gate_up.view(E * 2I, hidden)^T             # [T, E * 2I] (one GEMM)
    h       = swiglu(gu[:, e, :I], gu[:, e, I:]) -> [E, T, I]  # moe_swiglu
    y       = bmm(h, down^T)                                 # [E, T, hidden] (one GEMM)
    out     = sum_e dense[:, e] * y[e]  (+ shared)           # expert_weighted_sum

``dense[t, e]`` is the sum of row ``t``'s routing weights for expert ``e`` (zero when not
routed; an expert named twice by a hash table counts twice). Triton path: CUDA tensors or
``KVPLAN_FORCE_TRITON=1``; torch path otherwise (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import triton_cdiv, triton_next_pow2

__all__ = [
    "expert_weighted_sum",
    "moe_route",
    "moe_swiglu",
    "swiglu",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# --- routing --------------------------------------------------------------------------------


def _check_route(logits, top_k, bias, tid2eid, input_ids) -> None:
    check_tensor("logits", logits, dtype=_FLOATS, ndim=2)
    t, e = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, {e}], got {top_k!r}")
    if (bias is None) == (tid2eid is None):
        raise ValueError("pass exactly one of bias (top-k router) and tid2eid (hash router)")
    if bias is not None:
        check_tensor("bias", bias, dtype=torch.float32, shape=(e,), device=logits.device)
    else:
        check_tensor("tid2eid", tid2eid, dtype=torch.int64, ndim=2, device=logits.device)
        if tid2eid.shape[1] != top_k:
            raise ValueError(f"tid2eid must have {top_k} columns, got {tid2eid.shape[1]}")
        check_tensor("input_ids", input_ids, dtype=torch.int64, shape=(t,), device=logits.device)


def moe_route_torch(
    logits: torch.Tensor, *, top_k: int, sigmoid: bool, scaling: float,
    bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch path of `moe_route`."""
    _check_route(logits, top_k, bias, tid2eid, input_ids)
    scores = logits.sigmoid() if sigmoid else F.softplus(logits).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids]
    else:
        ids = (scores + bias).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    dense = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    dense.scatter_add_(1, ids, weights.float())
    return ids, weights, dense


def moe_route_triton(
    logits: torch.Tensor, *, top_k: int, sigmoid: bool, scaling: float,
    bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Triton path of `moe_route` (one kernel; ties in the top-k go to the lower expert id)."""
    from kvplan.ops._moe_kernels import moe_route_kernel

    _check_route(logits, top_k, bias, tid2eid, input_ids)
    t, e = logits.shape
    dev = logits.device
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=dev)
    dense = torch.empty(t, e, dtype=torch.float32, device=dev)
    if t == 0:
        return ids, weights, dense
    hashed = tid2eid is not None
    logits = logits if logits.stride(1) == 1 else logits.contiguous()  # rows may be strided
    moe_route_kernel[(t,)](
        logits, ids if hashed else bias,
        tid2eid.contiguous() if hashed else ids, input_ids if hashed else ids,
        ids, weights, dense, e, logits.stride(0), float(scaling),
        TOP_K=top_k, K_P=triton_next_pow2(top_k), E_P=triton_next_pow2(e), SIGMOID=sigmoid,
        HASH=hashed, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return ids, weights, dense


def moe_route(
    logits: torch.Tensor, *, top_k: int, sigmoid: bool, scaling: float,
    bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Route rows by their router ``logits [T, E]`` (fp32/bf16/fp16; any row stride, e.g. a
    column slice of a wider GEMM's output).

    ``scores = sigmoid(logits)`` if ``sigmoid`` else ``sqrt(softplus(logits))`` (in the logits'
    dtype); experts = top-k of ``scores + bias`` (fp32 ``bias [E]``) or, for a hash router,
    ``tid2eid[input_ids]`` (int64 ``[V, top_k]``, int64 ``input_ids [T]``); weights = their
    scores renormalised to sum 1 (``+ 1e-20``), times ``scaling``.

    Returns:
        (expert ids int64 ``[T, top_k]``, weights ``[T, top_k]`` in the logits' dtype,
        ``dense`` fp32 ``[T, E]``: each row's weights summed per expert, zero elsewhere).
    """
    fn = moe_route_triton if use_triton(logits) else moe_route_torch
    return fn(
        logits, top_k=top_k, sigmoid=sigmoid, scaling=scaling, bias=bias, tid2eid=tid2eid,
        input_ids=input_ids,
    )  # fmt: skip


# --- SwiGLU ---------------------------------------------------------------------------------


def _check_swiglu(gu: torch.Tensor, num_experts: int) -> tuple[int, int]:
    check_tensor("gu", gu, dtype=_FLOATS, ndim=2)
    t, width = gu.shape
    if num_experts < 1 or width % (2 * num_experts):
        raise ValueError(f"gu width {width} is not num_experts ({num_experts}) x 2I")
    return t, width // (2 * num_experts)


def moe_swiglu_torch(gu: torch.Tensor, num_experts: int, limit: float) -> torch.Tensor:
    """Torch path of `moe_swiglu`."""
    t, inter = _check_swiglu(gu, num_experts)
    g, u = gu.view(t, num_experts, 2, inter).unbind(2)  # [T, E, I] each
    h = F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
    return h.transpose(0, 1).contiguous()


def moe_swiglu_triton(gu: torch.Tensor, num_experts: int, limit: float) -> torch.Tensor:
    """Triton path of `moe_swiglu` (one kernel)."""
    from kvplan.ops._moe_kernels import swiglu_kernel

    t, inter = _check_swiglu(gu, num_experts)
    out = torch.empty(num_experts, t, inter, dtype=gu.dtype, device=gu.device)
    if t == 0:
        return out
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    tile = min(triton_next_pow2(inter), 128 if triton_interpreting() else 1024)
    st, se = gu.stride(0), 2 * inter
    swiglu_kernel[(t, num_experts, triton_cdiv(inter, tile))](
        gu, gu[:, inter:], out, inter, float(limit), st, se, st, se, inter, t * inter,
        TILE_I=tile, num_warps=4,
    )  # fmt: skip
    return out


def moe_swiglu(gu: torch.Tensor, num_experts: int, limit: float) -> torch.Tensor:
    """SwiGLU of every expert's ``[gate | up]`` block of ``gu``, laid out per expert.

    Args:
        gu: ``[T, E * 2I]`` (fp32/bf16/fp16, unit column stride): ``x @ gate_up.view(E*2I, H)^T``;
            columns ``[e*2I, e*2I + I)`` are expert ``e``'s gate, the next ``I`` its up.
        num_experts: ``E``; limit: gate clamped above, up clamped to ``[-limit, limit]``.

    Returns:
        ``[E, T, I]`` in ``gu``'s dtype: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.
    """
    fn = moe_swiglu_triton if use_triton(gu) else moe_swiglu_torch
    return fn(gu, num_experts, limit)


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Torch path of `swiglu` (the reference)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton path of `swiglu` (one kernel)."""
    from kvplan.ops._moe_kernels import swiglu_kernel

    check_tensor("gate", gate, dtype=_FLOATS, ndim=2)
    check_tensor("up", up, dtype=gate.dtype, shape=gate.shape, device=gate.device)
    t, inter = gate.shape
    out = torch.empty(t, inter, dtype=gate.dtype, device=gate.device)
    if t == 0 or inter == 0:
        return out
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    tile = min(triton_next_pow2(inter), 128 if triton_interpreting() else 1024)
    swiglu_kernel[(t, 1, triton_cdiv(inter, tile))](
        gate, up, out, inter, float(limit), gate.stride(0), 0, up.stride(0), 0, inter, 0,
        TILE_I=tile, num_warps=4,
    )  # fmt: skip
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` for ``gate``, ``up`` ``[T, I]``
    (same dtype); a new ``[T, I]`` tensor in that dtype."""
    if gate.dim() == 2 and use_triton(gate):
        return swiglu_triton(gate, up, limit)
    return swiglu_torch(gate, up, limit)


# --- weighted sum over experts --------------------------------------------------------------


def _check_sum(y, dense, add) -> None:
    check_tensor("y", y, dtype=_FLOATS, ndim=3)
    e, t, hidden = y.shape
    check_tensor("dense", dense, dtype=torch.float32, shape=(t, e), device=y.device)
    if add is not None:
        check_tensor("add", add, dtype=y.dtype, shape=(t, hidden), device=y.device)


def expert_weighted_sum_torch(
    y: torch.Tensor, dense: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch path of `expert_weighted_sum`."""
    _check_sum(y, dense, add)
    out = torch.einsum("eth,te->th", y.float(), dense).to(y.dtype)
    return out if add is None else out + add


def expert_weighted_sum_triton(
    y: torch.Tensor, dense: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton path of `expert_weighted_sum` (one kernel)."""
    from kvplan.ops._moe_kernels import expert_sum_kernel

    _check_sum(y, dense, add)
    e, t, hidden = y.shape
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    tile = min(triton_next_pow2(hidden), 128 if triton_interpreting() else 512)
    expert_sum_kernel[(t, triton_cdiv(hidden, tile))](
        y.contiguous(), dense.contiguous(), out if add is None else add.contiguous(), out,
        t, e, hidden, HAS_ADD=add is not None, TILE_H=tile, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


def expert_weighted_sum(
    y: torch.Tensor, dense: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = round(sum_e dense[t, e] * y[e, t]) (+ add[t])`` in ``y``'s dtype.

    ``y [E, T, H]`` (fp32/bf16/fp16) the experts' outputs, ``dense`` fp32 ``[T, E]`` from
    `moe_route`, ``add`` optional ``[T, H]`` in ``y``'s dtype (the shared expert's output),
    added after the weighted sum is rounded. The sum runs in fp32 (Triton: experts in order).
    """
    fn = expert_weighted_sum_triton if use_triton(y) else expert_weighted_sum_torch
    return fn(y, dense, add)
