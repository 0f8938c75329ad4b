"""DeepSeek-V4's RMSNorms over the last dim, one kernel each on CUDA.

* `rms_norm_fp32w`: ``(w * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)`` with everything in fp32
  (``w`` is kept in fp32 whatever the activation dtype);
* `unweighted_rms_norm`: ``x * rsqrt(mean(x^2) + eps).to(x.dtype)``: the scale is computed in
  fp32, rounded to ``x``'s dtype and applied in that dtype.

(`kvplan.models.fused.rms_norm` is Llama's variant: weight in the model dtype, multiplied after
the rounding.) Triton path: CUDA tensors or ``KVPLAN_FORCE_TRITON=1``; one program per row.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.cache_geometry import triton_next_pow2

__all__ = [
    "rms_norm_fp32w",
    "rms_norm_fp32w_torch",
    "rms_norm_fp32w_triton",
    "unweighted_rms_norm",
    "unweighted_rms_norm_torch",
    "unweighted_rms_norm_triton",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@jit
def weighted_rms_norm(x, w, inv_n, eps):
    """``w * (x * rsqrt(sum(x^2) * inv_n + eps))`` of one fp32 row ``x`` (masked columns 0)
    and its fp32 weights ``w``. `_rms_norm_kernel` and the ``NORM`` epilogue of
    ``kvplan.ops._hyper_connection_kernels.hc_pre_kernel`` share it, both launched without fp
    contraction: the same operations, the sum of squares in each program's reduction order."""
    rrms = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
    return w * (x * rrms)


@jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_cols, stride_x, inv_n, eps,
    HAS_WEIGHT: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILE_N)
    mask = cols < n_cols
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = weighted_rms_norm(x, w, inv_n, eps)
    else:
        rrms = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        y = x * rrms.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(dtype), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    check_tensor("x", x, dtype=_FLOATS)
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or n == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    rows = x.reshape(-1, n)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    tile = triton_next_pow2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, x if weight is None else weight.contiguous(), out, n, rows.stride(0), 1.0 / n, eps,
        HAS_WEIGHT=weight is not None, TILE_N=tile, num_warps=max(1, min(16, tile // 512)),
        enable_fp_fusion=False,
    )  # fmt: skip
    return out.view(x.shape)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, dtype=_FLOATS)
    n = x.shape[-1] if x.dim() else 0
    check_tensor("weight", weight, dtype=_FLOATS, shape=(n,), device=x.device)


def rms_norm_fp32w_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch path of `rms_norm_fp32w` (the reference)."""
    _check_weight(x, weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_fp32w_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton path of `rms_norm_fp32w` (one kernel)."""
    _check_weight(x, weight)
    return _launch(x, weight, eps)


def rms_norm_fp32w(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm of ``x [..., N]`` (fp32/bf16/fp16) with ``weight [N]`` (fp32, or
    widened to it), computed in fp32; returns a new ``[..., N]`` tensor in ``x``'s dtype."""
    fn = rms_norm_fp32w_triton if use_triton(x) else rms_norm_fp32w_torch
    return fn(x, weight, eps)


def unweighted_rms_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch path of `unweighted_rms_norm` (the reference)."""
    check_tensor("x", x, dtype=_FLOATS)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def unweighted_rms_norm_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton path of `unweighted_rms_norm` (one kernel)."""
    return _launch(x, None, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., N]`` without a weight: the fp32 scale is rounded to ``x``'s dtype
    and applied in it; returns a new ``[..., N]`` tensor in ``x``'s dtype."""
    fn = unweighted_rms_norm_triton if use_triton(x) else unweighted_rms_norm_torch
    return fn(x, eps)
