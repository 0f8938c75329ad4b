"""Host length vectors for ``prepare()``: validated int32 copies and exclusive prefix sums.

Both run every step on every backend, so they are written for few numpy calls: a list of
plain Python ints becomes int32 in one ``sum`` (type check and bound) and one conversion
(which raises on values that do not fit), and a decode step's list of ones in none.

Hot paths call ufunc reductions (``MIN(a)`` = ``np.minimum.reduce``) and array methods
(``CUMSUM(a, out=...)``, ``a.repeat(r)``) directly: ``a.min()``, ``np.cumsum`` and ``np.repeat``
go through two to four Python-level wrapper calls each, which is most of their cost on the
small arrays of one step (``bench/host_primitives.py`` measures them).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch

from kvplan._checks import INT32_MAX

IntArrayLike = Sequence[int] | np.ndarray | torch.Tensor


# One C call each (no Python wrapper); they raise on empty arrays, so callers check sizes.
MIN = np.minimum.reduce
MAX = np.maximum.reduce
SUM = np.add.reduce  # int32 input accumulates in int64 (numpy's rule for add reductions)
# inclusive prefix sum (a.cumsum(out=) resolves dtypes in Python first)
CUMSUM = np.add.accumulate


# A validated length vector ``(array, total, all_ones)``: a fresh int32 ``array`` ``[n]``
# (never written again, so CPU tensors over it are private), its ``total`` (a Python int) and
# whether every entry is 1 (a decode step's query lengths). A plain tuple: a NamedTuple's
# constructor is one more Python-level call per step.
HostLengths = tuple[np.ndarray, int, bool]


def as_int32_array(name: str, value: IntArrayLike) -> np.ndarray:
    """Host copy of an integer vector as a 1-D int32 numpy array; rejects negatives/overflow.

    The result is always a fresh array, so later changes of the caller's list/array/tensor
    cannot reach it.
    """
    return as_lengths(name, value)[0]


def as_lengths(name: str, value: IntArrayLike) -> HostLengths:
    """``as_int32_array`` plus the vector's sum and whether it is all ones.

    A list of plain Python ints costs one C-level ``sum`` (which is also the type check) and
    one conversion through ``array("I")`` (unsigned: it raises on negatives); when the sum fits in int32,
    so does every (non-negative) value, so no reduction over the array is needed. A list of
    ones is recognized by ``list.count`` (identity compares) and needs no conversion at all.
    """
    if isinstance(value, (list, tuple)):
        total = _python_int_sum(value)
        if total is not None:
            n = len(value)
            if total == n and value.count(1) == n:  # all ones (bools count as ints)
                ones = np.empty(n, np.int32)  # (np.ones is a Python wrapper around these two)
                ones.fill(1)
                return (ones, total, n > 0)
            if total <= INT32_MAX:
                try:
                    # array('I') converts a list of ints in one C pass and raises on
                    # negatives; every value <= total <= INT32_MAX, so int32 holds it
                    arr = np.frombuffer(array("I", value), np.int32)
                    return (arr, total, False)  # sum == n with a non-1 entry
                except OverflowError:  # a negative value: named below
                    pass
            # Plain Python ints (a float or numpy scalar anywhere makes the sum another type
            # and takes the general path, which rejects floats): fromiter raises on overflow.
            if min(value) < 0:
                raise ValueError(f"{name} holds {min(value)}; lengths must be >= 0")
            try:
                arr = np.fromiter(value, np.int32, n)
            except OverflowError:
                raise ValueError(f"{name} holds {max(value)}, which overflows int32") from None
            return (arr, total, False)
    elif type(value) is np.ndarray and value.dtype == np.int32 and value.ndim == 1:
        arr = value.copy()  # private: later changes of the caller's array are safe
        if not arr.size:
            return (arr, 0, False)
        lo = int(MIN(arr))
        if lo < 0:
            raise ValueError(f"{name} holds {lo}; lengths must be >= 0")
        total = int(SUM(arr))
        return (arr, total, lo == 1 and total == arr.size)
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
    if not arr.size:
        return (arr.astype(np.int32), 0, False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"{name} holds {lo}; lengths must be >= 0")
    if hi > INT32_MAX:
        raise ValueError(f"{name} holds {hi}, which overflows int32")
    arr = arr.astype(np.int32)  # always a copy: later changes of the caller's array are safe
    return (arr, int(SUM(arr)), lo == 1 and hi == 1)


def _python_int_sum(values: Sequence) -> int | None:
    """The sum of ``values`` when they are plain Python ints only, else None (one C-level
    pass: the sum of ints is an int; a float, numpy scalar or nested list makes it something
    else or raises)."""
    try:
        total = sum(values, 0)
    except TypeError:
        return None
    return total if type(total) is int else None
