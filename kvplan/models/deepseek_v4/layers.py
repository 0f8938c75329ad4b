"""Small shared pieces: RMSNorms and DeepSeek-V4's interleaved partial RoPE.

RoPE rotates only the trailing ``rope_head_dim`` channels of a row (layout ``[nope | rope]``),
pairing *adjacent* channels ``(2i, 2i+1)`` with frequency ``inv_freq[i]``::

    y[2i]   = x[2i] * cos_i - x[2i+1] * sin_i
    y[2i+1] = x[2i+1] * cos_i + x[2i] * sin_i

Because K = V, the attention output carries the keys' rotation; the model undoes it by
applying the same table with ``-sin`` at the *query* position (`apply_rope(..., inverse=True)`).
As in Hugging Face, ``cos`` / ``sin`` are rounded to the activation dtype before the fp32
rotation, and the unweighted RMSNorm multiplies in the activation dtype.
"""

from __future__ import annotations

import math

import torch

from kvplan.models.deepseek_v4.config import RopeSpec
from kvplan.ops.rms_norm import rms_norm_fp32w
from kvplan.ops.rms_norm import unweighted_rms_norm as _unweighted_rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim, computed in fp32 (``weight`` is kept in fp32); one
    Triton kernel on CUDA (`kvplan.ops.rms_norm.rms_norm_fp32w`)."""
    return rms_norm_fp32w(x, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight; the scale is computed in fp32 and applied in ``x``'s dtype
    (`kvplan.ops.rms_norm.unweighted_rms_norm`)."""
    return _unweighted_rms_norm(x, eps)


def rope_inv_freq(rope: RopeSpec, rope_head_dim: int) -> torch.Tensor:
    """fp32 ``[rope_head_dim // 2]`` inverse frequencies of ``rope`` (default or YaRN)."""
    d = rope_head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    base = rope.theta**exponents  # [d/2]
    inv_freq = 1.0 / base
    if rope.rope_type != "yarn":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        omax = rope.original_max_position_embeddings
        return d * math.log(omax / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return (1.0 / (rope.factor * base)) * (1 - keep) + inv_freq * keep


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin``: ``[T, rope_head_dim // 2]`` in ``dtype`` for int64 ``positions [T]``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` ``[T, D]`` or ``[T, H, D]``.

    ``cos``/``sin``: ``[T, R/2]``; the rotation runs in fp32 and returns ``x``'s dtype.
    ``inverse`` rotates by the opposite angle (``-sin``).
    """
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


class Rope(torch.nn.Module):
    """One rotary table (``inv_freq`` buffer, attention scale) over the trailing rotary dims."""

    def __init__(self, rope: RopeSpec, rope_head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, rope_head_dim), persistent=False)
        self.scale = rope.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin``: ``[T, R/2]`` in ``dtype`` for int64 ``positions [T]``."""
        return rope_cos_sin(positions, self.inv_freq, self.scale, dtype)
