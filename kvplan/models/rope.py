"""Rotary position embeddings: inverse frequencies (default / linear / llama3) and application.

The arithmetic follows Hugging Face transformers step by step (fp32 frequencies, ``cos`` and
``sin`` of ``position * inv_freq`` duplicated over both halves, ``rotate_half``), so that CPU
fp32 logits match it to the last bits and greedy decoding is token-identical.
"""

from __future__ import annotations

import math

import torch

from kvplan.models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 CPU inverse frequencies, scaled as ``rope.rope_type`` says.

    * default: ``1 / theta ** (2i / D)``;
    * linear:  default divided by ``factor``;
    * llama3:  wavelengths above ``original_max / low_freq_factor`` are divided by ``factor``,
      those below ``original_max / high_freq_factor`` are kept, and the band between is a
      linear blend (Llama 3.1 scaling).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv_freq


class RotaryTable:
    """Precomputed ``cos``/``sin`` rows for positions ``0 .. max_positions - 1``.

    ``cos``/``sin``: ``[max_positions, head_dim]`` in the model dtype, on the model device,
    allocated once (CUDA-graph safe: a step only gathers rows by position).
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        if max_positions <= 0:
            raise ValueError(f"max_positions must be > 0, got {max_positions}")
        inv_freq = inv_frequencies(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.max_positions = max_positions
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by ``positions [T]`` (int64, device)."""
        return rotate_qk(q, k, self.cos, self.sin, positions)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate` of ``q [T, H, D]`` and ``k [T, Hkv, D]`` by the rows ``positions [T]`` of the
    ``cos``/``sin [P, D]`` tables."""
    cos = cos[positions].unsqueeze(1)  # [T, 1, D]
    sin = sin[positions].unsqueeze(1)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, n, D]`` and ``cos``/``sin [T, 1, D]``.

    Each product and the sum are rounded to the dtype (the steps `kvplan.models.fused`'s
    kernel repeats).
    """
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
