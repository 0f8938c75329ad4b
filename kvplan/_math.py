"""Integer helpers shared by the whole package: ceiling division and the exclusive prefix sum.

Every module that needs ``ceil(a / b)`` or ``cu_seqlens``-style offsets uses these two, so the
rounding and the ``n + 1`` length convention have one definition.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from kvplan._checks import INT32_MAX

IntLike = TypeVar("IntLike", int, np.ndarray)


def cdiv(a: IntLike, b: int) -> IntLike:
    """``ceil(a / b)`` for integers ``a >= 0``, ``b >= 1`` (Python ints or numpy int arrays,
    elementwise).

    Example: ``cdiv(9, 4) == 3``, ``cdiv(8, 4) == 2``, ``cdiv(np.array([0, 5]), 4)`` is
    ``[0, 2]``.
    """
    return -(-a // b)


def exclusive_cumsum(lengths, total: int | None = None, *, dtype=np.int64) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]``: the ``n + 1`` offsets of ``n`` lengths (``cu_seqlens``).

    Args:
        lengths: ``[n]`` integers (or bools, counted as 0/1): a numpy array or a sequence.
        total: ``sum(lengths)`` when the caller already knows it; only used for the int32
            overflow check.
        dtype: ``np.int64`` (default) or ``np.int32``; int32 offsets are checked to fit.

    Returns:
        A fresh ``[n + 1]`` array of ``dtype``.

    Raises:
        ValueError: int32 offsets whose total exceeds ``2**31 - 1``.

    Example: ``exclusive_cumsum([3, 0, 2])`` is ``[0, 3, 3, 5]``.
    """
    out = np.empty(len(lengths) + 1, dtype)
    out[0] = 0
    if out.itemsize < 8:
        if total is None:
            total = int(np.add.reduce(lengths, dtype=np.int64))
        if total > INT32_MAX:
            raise ValueError(f"total length {total} overflows int32")
    np.add.accumulate(lengths, dtype=dtype, out=out[1:])
    return out
