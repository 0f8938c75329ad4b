"""Host-side integer arrays for ``prepare()``: validated int32 copies and prefix sums."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IntArrayLike = Sequence[int] | np.ndarray | torch.Tensor


def as_int32_array(name: str, value: IntArrayLike) -> np.ndarray:
    """Host copy of an integer vector as a 1-D int32 numpy array; rejects negatives/overflow."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (host values), got {value.device}")
        arr = value.numpy()
    else:
        arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        if arr.size or arr.ndim != 1:
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < 0:
            raise ValueError(f"{name} holds {int(lo)}; lengths must be >= 0")
        if hi > 2**31 - 1:
            raise ValueError(f"{name} holds {int(hi)}, which overflows int32")
    return arr.astype(np.int32)  # always a copy: later changes of the caller's array are safe


def exclusive_cumsum(lens: np.ndarray) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` as int32 ``[n + 1]`` (overflow-checked)."""
    out = np.empty(lens.size + 1, np.int64)
    out[0] = 0
    np.cumsum(lens, out=out[1:])
    if out[-1] > 2**31 - 1:
        raise ValueError(f"total length {int(out[-1])} overflows int32")
    return out.astype(np.int32)
