"""Triton helpers shared by kvplan's kernels."""

from __future__ import annotations

import triton
import triton.language as tl

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
