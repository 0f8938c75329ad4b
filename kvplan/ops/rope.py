"""DeepSeek-V4's interleaved partial RoPE, optionally behind the row's RMSNorm, in one kernel.

``norm_rope(x, cos, sin, norm=..., inverse=...)`` returns a new ``x``-shaped tensor (``[T, D]``
or ``[T, H, D]``, any float dtype) whose rows of ``D`` channels are::

    y = x                                       norm None
    y = rms_norm_fp32w(x, weight, eps)          norm NormSpec(weight, eps)   (fp32 weight)
    y = unweighted_rms_norm(x, eps)             norm NormSpec(None, eps)
    then the trailing RD = 2 * cos.shape[-1] channels of y, adjacent pairs (2i, 2i + 1)
    rotated by the angle of ``cos[t, i]`` / ``sin[t, i]`` in fp32 (``-sin`` when ``inverse``),
    and rounded to ``x``'s dtype; the leading D - RD channels pass through.

(the norms as `kvplan.ops.rms_norm` defines them, rounded to ``x``'s dtype before the
rotation, like the two calls in sequence). ``cos`` and ``sin`` are ``[T, RD / 2]`` in the
activation dtype (Hugging Face rounds them before the fp32 rotation); every head of a token
uses the token's row.

Paths: :func:`norm_rope_torch` composes the torch ops; :func:`norm_rope_triton` is one
program per row of ``D`` channels, its rotation compiled without fused multiply-adds so each
product and difference rounds once, as the torch ops do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops._triton_util import round_to
from kvplan.ops.cache_geometry import triton_next_pow2
from kvplan.ops.rms_norm import rms_norm_fp32w_torch, unweighted_rms_norm_torch

__all__ = [
    "NormSpec",
    "norm_rope",
    "norm_rope_pair",
    "norm_rope_pair_triton",
    "norm_rope_torch",
    "norm_rope_triton",
    "rope_and_scale",
    "rope_and_scale_triton",
    "rope_cos_sin",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class NormSpec(NamedTuple):
    """The RMSNorm in front of the rotation: fp32 ``weight [D]`` (None: unweighted) and eps."""

    weight: torch.Tensor | None
    eps: float


@jit
def _norm_rope_row(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, t, src, dst, stride_c, inv_n, eps,
    D: tl.constexpr, HALF_RD: tl.constexpr, NORM: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """One row of ``D`` channels at element offsets ``src`` / ``dst`` of token ``t``: norm (0
    none, 1 fp32 weight, 2 unweighted), then the rotation."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + src + cols).to(tl.float32)
    if NORM != 0:
        rrms = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        if NORM == 1:
            x = round_to(tl.load(w_ptr + cols) * (x * rrms), dtype)
        else:
            x = round_to(x * round_to(rrms, dtype), dtype)
    x0, x1 = tl.split(tl.reshape(x, [D // 2, 2]))  # channels 2i, 2i + 1
    pair = tl.arange(0, D // 2) - (D // 2 - HALF_RD)  # rotary pair index; < 0: passes through
    rot = pair >= 0
    c = tl.load(cos_ptr + t * stride_c + pair, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + pair, mask=rot, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    y0 = tl.where(rot, x0 * c - x1 * s, x0)
    y1 = tl.where(rot, x1 * c + x0 * s, x1)
    y = tl.reshape(tl.join(y0, y1), [D])
    tl.store(out_ptr + dst + cols, y.to(dtype))


@jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_c, inv_n, eps,
    x2_ptr, w2_ptr, out2_ptr, stride_x2t, v_ptr, v_out_ptr, stride_vt, n_v, v_scale,
    D: tl.constexpr, HALF_RD: tl.constexpr, NORM: tl.constexpr, INVERSE: tl.constexpr,
    NORM2: tl.constexpr, PAIR: tl.constexpr, V_P: tl.constexpr,
):  # fmt: skip
    """Row ``(t, h)`` of ``x`` (programs ``t * heads + h``); with ``PAIR``, programs
    ``T * heads + t`` take row ``t`` of the second tensor ``x2 [T, D]`` with its own norm
    ``NORM2`` (the same row code: the same bits as a launch of its own). With ``V_P`` (the
    padded width of ``v [T, n_v]``), the program of ``(t, 0)`` also writes row ``t`` of
    ``v`` as fp32 times ``v_scale`` (`rope_and_scale`)."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.num_programs(0).to(tl.int64)  # rows of x: all programs, or T * heads (PAIR)
    if PAIR:
        first = first // (heads + 1) * heads
    if row < first:
        t = row // heads
        h = row % heads
        _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, t, t * stride_xt + h * stride_xh,
                       row * D, stride_c, inv_n, eps, D, HALF_RD, NORM, INVERSE)  # fmt: skip
        if V_P > 0:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if h == 0:
                cols = tl.arange(0, V_P)
                v = tl.load(v_ptr + t * stride_vt + cols, mask=cols < n_v).to(tl.float32)
                tl.store(v_out_ptr + t * n_v + cols, v * v_scale, mask=cols < n_v)
    elif PAIR:
        t = row - first
        _norm_rope_row(x2_ptr, w2_ptr, cos_ptr, sin_ptr, out2_ptr, t, t * stride_x2t, t * D,
                       stride_c, inv_n, eps, D, HALF_RD, NORM2, INVERSE)  # fmt: skip


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin``: ``[T, RD / 2]`` in ``dtype`` for int64 ``positions [T]`` and fp32
    ``inv_freq [RD / 2]``: ``cos(position * inv_freq) * scale`` rounded to ``dtype`` (likewise
    ``sin``)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def _check(x, cos, sin, norm):
    check_tensor("x", x, dtype=_FLOATS)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, D] or [T, H, D], got shape {tuple(x.shape)}")
    t, d = x.shape[0], x.shape[-1]
    check_tensor("cos", cos, dtype=_FLOATS, ndim=2, device=x.device)
    half = cos.shape[1]
    if cos.shape[0] != t or not 0 < 2 * half <= d:
        raise ValueError(
            f"cos must be [T, RD / 2] with T = {t} and 0 < RD <= D = {d}, got {tuple(cos.shape)}"
        )
    check_tensor("sin", sin, dtype=cos.dtype, shape=(t, half), device=x.device)
    if d % 2:
        raise ValueError(f"x's last dim must be even, got {d}")
    if norm is not None:
        if not isinstance(norm, NormSpec):
            raise TypeError(f"norm must be a NormSpec or None, got {type(norm).__name__}")
        if norm.weight is not None:
            check_tensor("norm.weight", norm.weight, dtype=torch.float32, shape=(d,))


def norm_rope_torch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: NormSpec | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Torch path of :func:`norm_rope` (see the module docstring)."""
    _check(x, cos, sin, norm)
    if norm is not None:
        w = norm.weight
        x = (
            unweighted_rms_norm_torch(x, norm.eps)
            if w is None
            else rms_norm_fp32w_torch(x, w, norm.eps)
        )
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    rd = 2 * cos.shape[-1]
    pairs = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def norm_rope_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: NormSpec | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Triton path of :func:`norm_rope`: one program per row (``D`` a power of two)."""
    _check(x, cos, sin, norm)
    return _rows_launch("norm_rope_triton", x, cos, sin, norm, inverse)[0]


def _rows_launch(
    name: str, x, cos, sin, norm: NormSpec | None, inverse: bool, v=None, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_norm_rope_kernel`` over every row of ``x`` (checked by the caller), and with ``v``
    the rows of ``v`` scaled by its head-0 programs: (out, scaled ``v`` or None)."""
    d = x.shape[-1]
    if triton_next_pow2(d) != d:
        raise ValueError(f"{name} needs a power-of-two last dim, got {d}")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    t, heads = x3.shape[0], x3.shape[1]
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = 0 if v is None else v.shape[1]
    v_out = None if v is None else torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if t * heads == 0 or (v is not None and n == 0):
        return out, None if v is None else v.float() * scale
    kind, w = _norm_kind(norm, cos)
    _norm_rope_kernel[(t * heads,)](
        x3, w, cos, sin, out, heads, x3.stride(0), x3.stride(1), cos.stride(0), 1.0 / d,
        float(norm.eps) if norm is not None else 0.0, x3, w, out, 0,
        x3 if v is None else v, out if v_out is None else v_out, 0 if v is None else v.stride(0),
        n, float(scale), D=d, HALF_RD=cos.shape[1], NORM=kind, INVERSE=bool(inverse), NORM2=0,
        PAIR=False, V_P=triton_next_pow2(n) if n else 0, num_warps=_warps(d),
        enable_fp_fusion=False,
    )  # fmt: skip
    return out, v_out


def _norm_kind(norm: NormSpec | None, cos: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(the kernel's NORM code, the weight pointer: ``cos`` stands in when unused)."""
    kind = 0 if norm is None else (2 if norm.weight is None else 1)
    return kind, norm.weight if kind == 1 else cos


def _warps(d: int) -> int:
    return 4 if d >= 512 else 1


def norm_rope_pair(
    x: torch.Tensor,
    x2: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: NormSpec,
    norm2: NormSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_rope(x, cos, sin, norm=norm), norm_rope(x2, cos, sin, norm=norm2))`` for ``x
    [T, H, D]`` and ``x2 [T, D]`` of the same dtype and ``D`` (a DeepSeek-V4 layer's queries
    and its K = V row): one launch on the Triton path (`norm_rope_pair_triton`), the same
    bits as two (each row runs the same code); the torch path is the two calls."""
    if not use_triton(x):
        return (norm_rope_torch(x, cos, sin, norm=norm), norm_rope_torch(x2, cos, sin, norm=norm2))
    return norm_rope_pair_triton(x, x2, cos, sin, norm, norm2)


def norm_rope_pair_triton(
    x: torch.Tensor,
    x2: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: NormSpec,
    norm2: NormSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`norm_rope_pair` (one launch)."""
    _check(x, cos, sin, norm)
    _check(x2, cos, sin, norm2)
    if x.dim() != 3 or x2.dim() != 2 or x2.shape[-1] != x.shape[-1] or x2.dtype != x.dtype:
        raise ValueError(
            f"norm_rope_pair needs x [T, H, D] and x2 [T, D] of one dtype, got {x.dtype} "
            f"{tuple(x.shape)} and {x2.dtype} {tuple(x2.shape)}"
        )
    d = x.shape[-1]
    if triton_next_pow2(d) != d:
        raise ValueError(f"norm_rope_pair needs a power-of-two last dim, got {d}")
    x = x if x.stride(2) == 1 else x.contiguous()
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    t, heads = x.shape[0], x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    if t == 0:
        return out, out2
    kind, w = _norm_kind(norm, cos)
    kind2, w2 = _norm_kind(norm2, cos)
    if heads == 0 or norm.eps != norm2.eps:  # one eps a launch: two launches then
        return norm_rope_triton(x, cos, sin, norm=norm), norm_rope_triton(x2, cos, sin, norm=norm2)
    _norm_rope_kernel[(t * (heads + 1),)](
        x, w, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), 1.0 / d,
        float(norm.eps), x2, w2, out2, x2.stride(0), x, out, 0, 0, 1.0, D=d,
        HALF_RD=cos.shape[1], NORM=kind, INVERSE=False, NORM2=kind2, PAIR=True, V_P=0,
        num_warps=_warps(d), enable_fp_fusion=False,
    )  # fmt: skip
    return out, out2


def _check_scaled(x: torch.Tensor, v: torch.Tensor) -> None:
    check_tensor("v", v, dtype=_FLOATS, ndim=2, device=x.device)
    if x.dim() != 3 or v.shape[0] != x.shape[0] or v.stride(1) != 1:
        raise ValueError(
            f"rope_and_scale needs x [T, H, D] and v [T, N] (unit column stride), got "
            f"{tuple(x.shape)} and {tuple(v.shape)} with strides {v.stride()}"
        )


def rope_and_scale(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_rope(x, cos, sin), v.float() * scale)`` for ``x [T, H, D]`` and ``v [T, N]`` (a
    DeepSeek-V4 indexer's queries and its head weights): one launch on the Triton path
    (`rope_and_scale_triton`, ``D`` a power of two), the same bits as the torch ops."""
    d = x.shape[-1] if x.dim() else 0
    if use_triton(x) and d > 0 and triton_next_pow2(d) == d:
        return rope_and_scale_triton(x, cos, sin, v, scale)
    _check_scaled(x, v)
    return norm_rope_torch(x, cos, sin), v.float() * scale


def rope_and_scale_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of `rope_and_scale`: `norm_rope_triton`'s programs, the head-0 program of
    each token also writing its row of ``v`` as fp32 times ``scale``."""
    _check(x, cos, sin, None)
    _check_scaled(x, v)
    return _rows_launch("rope_and_scale_triton", x, cos, sin, None, False, v, scale)


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: NormSpec | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """The optional RMSNorm, then the partial RoPE (module docstring); Triton on CUDA when
    ``D`` is a power of two, torch otherwise."""
    d = x.shape[-1] if x.dim() else 0
    if use_triton(x) and d > 0 and triton_next_pow2(d) == d:
        return norm_rope_triton(x, cos, sin, norm=norm, inverse=inverse)
    return norm_rope_torch(x, cos, sin, norm=norm, inverse=inverse)
