"""Dispatch rule for ops: CUDA tensors run the Triton kernel, CPU tensors the torch path.

Tests call each op's ``*_triton`` entry point directly on CPU tensors with
``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` when there is no GPU).
"""

from __future__ import annotations

import functools
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run for tensors on ``t``'s device."""
    if t.is_cuda:
        return True
    return os.environ.get("KVPLAN_FORCE_TRITON", "") == "1"


def env_flag(name: str, default: bool) -> bool:
    """The 0 / 1 switch in environment variable ``name`` (unset: ``default``), or a
    ValueError naming the variable and the value it got."""
    text = os.environ.get(name, "1" if default else "0").strip()
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def env_count(name: str, default: int) -> int:
    """The non-negative int in environment variable ``name`` (unset: ``default``), or a
    ValueError naming the variable and the value it got."""
    text = os.environ.get(name)
    if text is None:
        return default
    if not text.strip().isdigit():
        raise ValueError(f"{name} must be a non-negative int, got {text!r}")
    return int(text)


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


if triton_interpreting():  # Triton 3.6's interpreter gets bf16 dots and casts wrong
    from kvplan.ops._interpreter_bf16 import install
    from kvplan.ops._interpreter_speed import install as install_speed

    install()
    install_speed()  # and re-patches the language for every call of a jit helper


@functools.cache
def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (cached: launch plans ask per call)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
