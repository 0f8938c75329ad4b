"""Triton helpers shared by kvplan's kernels.

Programmatic dependent launch (PDL, sm_90+), ``KVPLAN_PDL`` at import: 0 (default) off; 1 the
kernels that call `pdl_prologue` are launched with ``launch_pdl`` (`pdl_launch`), so the GPU
may start a kernel before the one before it in the stream has finished, and every such kernel
waits (``griddepcontrol.wait``) for that one to complete, and its writes to be visible, before
it reads or writes memory; 2 as 1, and each also lets the next kernel launch as soon as all of
its own programs have started (``griddepcontrol.launch_dependents``). Under CUDA-graph capture
the launches become programmatic edges of the graph. A kernel launched without PDL (or on a
GPU without it) runs the wait as a no-op.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _pdl_mode() -> int:
    text = os.environ.get("KVPLAN_PDL", "").strip()
    if not text:
        return 0
    if text not in ("0", "1", "2"):
        raise ValueError(f"KVPLAN_PDL must be 0, 1 or 2, got {text!r}")
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return 0  # the interpreter has no grid dependency control
    return int(text)


PDL_MODE = _pdl_mode()
PDL = tl.constexpr(PDL_MODE)  # a jit-visible global must be a constexpr


@triton.jit
def pdl_prologue():
    """A PDL kernel's first step (`PDL_MODE`): wait for the kernel before it; with mode 2
    then let the next one launch."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()


def pdl_launch(tensor=None) -> dict:
    """Launch options of a kernel that calls `pdl_prologue` over CUDA ``tensor``'s device
    (None: the current CUDA device): ``{"launch_pdl": True}`` when PDL is on and the GPU has
    it (sm_90+), else none."""
    if not PDL_MODE or (tensor is not None and not tensor.is_cuda):
        return {}
    index = None if tensor is None else tensor.device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return {"launch_pdl": _has_pdl(index)}


_PDL_DEVICES: dict[int, bool] = {}


def _has_pdl(index: int) -> bool:
    if index not in _PDL_DEVICES:
        import torch

        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


MERGE_COUNTERS = 1 << 16
"""int32 counters a device keeps for kernels whose last-arriving program merges the other
programs' partials (split attention): each launch counts its programs in on its own
counters and leaves them zero, so launches in one stream (and CUDA-graph replays) share the
buffer; kernels on two streams at once must not."""
_merge_counters: dict = {}


def merge_counters(device):
    """The device's ``MERGE_COUNTERS`` zeroed int32 counters (allocated on first use)."""
    buf = _merge_counters.get(device)
    if buf is None:
        import torch

        buf = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
        _merge_counters[device] = buf
    return buf


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (as torch stores an intermediate) and widened again."""
    return x.to(dtype).to(tl.float32)
