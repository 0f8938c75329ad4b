"""Triton helpers shared by kvplan's kernels."""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit

MERGE_COUNTERS = 1 << 16
"""Size of a buffer of int32 counters for kernels whose last-arriving program merges the
other programs' partials (split attention). Each launch counts its programs in on its own
counters and leaves them zero, so the launches of one stream, CUDA-graph replays included,
can share a buffer; launches that may run at once (two streams) must not."""
_merge_counters: dict = {}


def new_merge_counters(device, size: int = MERGE_COUNTERS):
    """A zeroed buffer of ``size`` int32 merge counters on ``device``, for a caller that owns
    its counters (e.g. one engine's model; see ``sparse_attention``'s ``counters``)."""
    import torch

    return torch.zeros(size, dtype=torch.int32, device=device)


def merge_counters(device):
    """The shared ``MERGE_COUNTERS`` counters of ``device`` and its current stream (allocated
    on first use): launches on one stream share them; a CUDA graph captured on a stream keeps
    that stream's buffer."""
    import torch

    device = torch.device(device)
    stream = 0
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)  # fmt: skip
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    buf = _merge_counters.get(key)
    if buf is None:
        buf = _merge_counters[key] = new_merge_counters(device)
    return buf


@jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (as torch stores an intermediate) and widened again."""
    return x.to(dtype).to(tl.float32)
