"""Caller-facing argument checks shared by every public function.

Each helper raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device,
range) with the argument's name and the offending value, so that bad input never reaches a
kernel as an out-of-range index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate ``t`` and return it. ``shape`` entries that are ``None`` match any size."""
    # (every call of an op runs this: the common, passing case takes the cheap comparisons)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype is not dtype:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {names}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and t.shape != shape and not _shape_matches(tuple(t.shape), shape):
        want_s = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want_s}, got {tuple(t.shape)}")
    if (
        device is not None
        and t.device != device
        and not same_device(t.device, torch.device(device))
    ):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    return t


def _shape_matches(got: tuple[int, ...], want: Sequence[int | None]) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):  # noqa: SIM110 (a loop: ~2x faster than all() on a generator)
        if w is not None and g != w:
            return False
    return True


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` and ``cuda:<current>`` count as the same device."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return True
    return a.index == b.index


def check_same_device(**tensors: torch.Tensor) -> None:
    """All named tensors must live on one device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if not same_device(t.device, first.device):
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every value of integer tensor ``t`` must satisfy ``low <= v < high``.

    Costs one reduction (and a device sync on CUDA); callers on a hot path may skip it with
    their own ``check=False`` flag.
    """
    if t.numel() == 0:
        return
    lo = int(t.min())
    hi = int(t.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise ValueError(f"{name} holds {bad}, outside the valid range [{low}, {high})")


INT32_MAX = 2**31 - 1


def check_int32(name: str, value: int) -> int:
    """An index or product that will be stored as int32 must fit (explicit overflow check)."""
    if not -(2**31) <= value <= INT32_MAX:
        raise ValueError(f"{name} = {value} overflows int32")
    return value
