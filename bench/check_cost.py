"""Host cost of `kvplan._checks.check_tensor` (every op checks its arguments with it): three
typical passing checks (a dtype tuple and ndim; dtype, shape and device; dtype, a shape with a
wildcard, device and contiguity), microseconds a check, best of three runs.

    PYTHONPATH=. python3 bench/check_cost.py
"""

from __future__ import annotations

import time

import torch

from kvplan._checks import check_tensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def per_check_us(calls: int = 200_000) -> float:
    x = torch.empty(16, 8, 512, dtype=torch.bfloat16)
    w = torch.empty(512)
    dev = x.device
    t0 = time.perf_counter()
    for _ in range(calls):
        check_tensor("x", x, dtype=FLOATS, ndim=3)
        check_tensor("w", w, dtype=torch.float32, shape=(512,), device=dev)
        check_tensor("x", x, dtype=torch.bfloat16, shape=(16, None, 512), device=dev,
                     contiguous=True)  # fmt: skip
    return (time.perf_counter() - t0) / calls / 3 * 1e6


if __name__ == "__main__":
    print(f"check_tensor: {min(per_check_us() for _ in range(3)):.3f} us a check")
