"""Triton helpers shared by kvplan's kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (as torch stores an intermediate) and widened again."""
    return x.to(dtype).to(tl.float32)
