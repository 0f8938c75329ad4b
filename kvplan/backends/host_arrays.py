"""Host-side integer arrays for ``prepare()``: validated int32 copies and prefix sums.

Both run every step on every backend, so they are written for few numpy calls: a list of
plain Python ints becomes int32 in one ``np.fromiter`` (which raises on values that do not
fit) and one ``min`` rejects negatives.

Hot paths call ufunc reductions (``MIN(a)`` = ``np.minimum.reduce``) and array methods
(``a.cumsum(out=...)``, ``a.repeat(r)``) directly: ``a.min()``, ``np.cumsum`` and ``np.repeat``
go through two to four Python-level wrapper calls each, which is most of their cost on the
small arrays of one step (and each wrapper call costs ~1 us on the GPU host's CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplan._checks import INT32_MAX

IntArrayLike = Sequence[int] | np.ndarray | torch.Tensor


# One C call each (no Python wrapper); they raise on empty arrays, so callers check sizes.
MIN = np.minimum.reduce
MAX = np.maximum.reduce
SUM = np.add.reduce  # int32 input accumulates in int64 (numpy's rule for add reductions)
ALL = np.logical_and.reduce


def as_int32_array(name: str, value: IntArrayLike) -> np.ndarray:
    """Host copy of an integer vector as a 1-D int32 numpy array; rejects negatives/overflow.

    The result is always a fresh array, so later changes of the caller's list/array/tensor
    cannot reach it.
    """
    if isinstance(value, (list, tuple)) and _all_python_ints(value):
        # Plain Python ints (a float or numpy scalar anywhere makes the sum another type and
        # takes the general path, which rejects floats): fromiter raises on int32 overflow.
        try:
            arr = np.fromiter(value, np.int32, len(value))
        except OverflowError:
            raise ValueError(f"{name} holds {max(value)}, which overflows int32") from None
        if arr.size and MIN(arr) < 0:
            raise ValueError(f"{name} holds {int(MIN(arr))}; lengths must be >= 0")
        return arr
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
        if hi > INT32_MAX:
            raise ValueError(f"{name} holds {int(hi)}, which overflows int32")
    return arr.astype(np.int32)  # always a copy: later changes of the caller's array are safe


def _all_python_ints(values: Sequence) -> bool:
    """Whether ``values`` holds plain Python ints only (one C-level pass: the sum of ints is an
    int; a float, numpy scalar or nested list makes it something else or raises)."""
    try:
        return type(sum(values, 0)) is int
    except TypeError:
        return False


def exclusive_cumsum(lens: np.ndarray, total: int | None = None) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` as int32 ``[n + 1]`` (overflow-checked).

    ``total``: ``sum(lens)`` when the caller already knows it (saves one pass); otherwise the
    sum is taken in int64 first.
    """
    if total is None:
        total = int(SUM(lens, dtype=np.int64))
    if total > INT32_MAX:
        raise ValueError(f"total length {total} overflows int32")
    out = np.empty(lens.size + 1, np.int32)
    out[0] = 0
    lens.cumsum(out=out[1:])
    return out
