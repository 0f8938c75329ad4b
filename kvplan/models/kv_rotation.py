"""Hadamard rotation of queries and keys for quantized KV caches.

A per-group quantized key cache loses most where a few channels of K carry most of its
magnitude (outlier channels): each group's scale follows the outlier and the other channels
round to few levels. Rotating every head's query and key by the same orthonormal matrix
``H [D, D]`` leaves the attention scores unchanged, ``(q H) (k H)^T = q H H^T k^T = q k^T``,
while ``k H`` spreads each outlier over all D channels, so its groups quantize with a far
smaller relative error. V is not rotated.

``H`` is the Sylvester Hadamard matrix of order D (a power of two) divided by ``sqrt(D)``:
``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; it is symmetric and orthonormal
(``H @ H = I``).

The attention modules of `kvplan.models.llama` and `kvplan.models.gemma3` apply
`hadamard_qk` right after RoPE, before K is stored, when their model was built with
``kv_rotation=True`` (``EngineConfig.kv_rotation``): every user of a cached key (prefill,
decode, speculative verification, prefix-cache hits, CUDA graph replays) runs through the
same modules, so cached keys and queries are always rotated alike. The rotation is per head,
so a tensor-parallel shard could apply it to its own heads unchanged.

Example::

    h = hadamard(64, torch.float32, torch.device("cpu"))  # [64, 64], h @ h.T == I
    q, k = hadamard_qk(q, k)  # q [T, H, 64], k [T, Hkv, 64]; q @ k.T unchanged
"""

from __future__ import annotations

import functools

import torch


def supports_rotation(head_dim: int) -> bool:
    """True when ``head_dim`` is a power of two (the Sylvester construction's orders)."""
    return head_dim >= 1 and head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=16)
def hadamard(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``[d, d]`` of ``dtype`` on ``device``.

    Built once per ``(d, dtype, device)`` in fp64, outside inference mode (so it may be used
    by autograd-tracked code too). Raises ``ValueError`` unless ``d`` is a power of two.
    """
    if not supports_rotation(d):
        raise ValueError(f"Hadamard rotation needs head_dim a power of two, got head_dim={d}")
    with torch.inference_mode(False):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / d**0.5).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D] @ H`` (a new contiguous tensor of ``x``'s dtype and device)."""
    return x @ hadamard(x.shape[-1], x.dtype, x.device)


def hadamard_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q H, k H)`` for ``q [T, H, D]``, ``k [T, Hkv, D]``: every head by the same ``H``."""
    return rotate(q), rotate(k)


def check_rotation_setting(setting: bool, head_dim: int) -> None:
    """Caller checks of a model's ``kv_rotation`` argument (TypeError / ValueError)."""
    if not isinstance(setting, bool):
        raise TypeError(f"kv_rotation must be a bool, got {setting!r}")
    if setting and not supports_rotation(head_dim):
        raise ValueError(f"kv_rotation=True needs head_dim a power of two, got head_dim={head_dim}")
