"""Host cost of one Triton launch on this machine: ``kernel[grid](...)`` (the JIT path every
kvplan op takes) against calling the compiled kernel's launcher directly with the arguments
already bound, and against kvplan's lean path (``kvplan.ops._launch.LeanJITFunction``: the
binder's specialization as the cache key, then the launcher's C entry), for a kernel with the
argument mix of kvplan's ops (pointers, ints, floats, constexprs); a torch op for scale.

Session 28's host profile of an eager DeepSeek-V4 step put ~50 us a launch (under cProfile)
into Triton's launch path, a third of the step; this measures whether a launcher that skips the
JIT path's per-call work (binder, cache key, hooks, metadata) would pay.

    PYTHONPATH=. python3 bench/triton_launch_cost.py --out launch.json   (CUDA)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from kvplan.ops._launch import LeanJITFunction


@triton.jit
def _probe_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, f_ptr, n, m, stride_a, stride_b, stride_c, scale, eps,
    TILE: tl.constexpr, FLAG: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    x = tl.load(a_ptr + i * stride_a, mask=i < n, other=0.0)
    if FLAG:
        x = x * scale + eps
    tl.store(c_ptr + i * stride_c, x, mask=i < n)


def per_call_us(fn, calls: int, reps: int) -> float:
    """Median over ``reps`` of the host microseconds a call of ``fn`` takes (``calls`` calls
    back to back, then one sync outside the timing)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev = torch.device("cuda")
    bufs = [torch.zeros(4096, device=dev) for _ in range(6)]
    kw = dict(TILE=1024, FLAG=True, MODE=2, num_warps=4)
    call = (*bufs, 4096, 1, 1, 1, 1, 1.5, 1e-6)
    grid = (4,)

    def jit_path():
        _probe_kernel[grid](*call, **kw)

    lean_kernel = LeanJITFunction(_probe_kernel.fn)

    def lean():
        lean_kernel[grid](*call, **kw)

    compiled = _probe_kernel[grid](*call, **kw)  # compiles; returns the CompiledKernel
    compiled._init_handles()
    stream = torch.cuda.current_stream(dev).cuda_stream
    # the JIT path hands the launcher every bound argument, constexprs included
    bound = (*call, kw["TILE"], kw["FLAG"], kw["MODE"])

    def direct():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *bound)  # fmt: skip

    out = torch.empty(4096, device=dev)

    def torch_op():
        torch.add(bufs[0], bufs[1], out=out)

    for f in (jit_path, direct, lean, lean, torch_op):
        f()
    torch.cuda.synchronize()
    # the direct launch must do what the JIT path does
    bufs[0].copy_(torch.arange(4096, device=dev, dtype=torch.float32))
    bufs[2].zero_()
    direct()
    got = bufs[2].clone()
    bufs[2].zero_()
    jit_path()
    if not torch.equal(got, bufs[2]):
        sys.exit("the direct launch wrote something else than the JIT path")
    bufs[2].zero_()
    lean()
    if not torch.equal(got, bufs[2]) or not lean_kernel.lean_launches:
        sys.exit("the lean launch did not run or wrote something else than the JIT path")
    rows = {
        name: per_call_us(f, args.calls, args.reps)
        for name, f in (
            ("jit_path", jit_path),
            ("direct_launcher", direct),
            ("kvplan_lean", lean),
            ("torch_add", torch_op),
        )
    }
    for name, us in rows.items():
        print(f"{name:>16}: {us:6.2f} us a call (host)")
    record = {
        "bench": "triton_launch_cost",
        "device": torch.cuda.get_device_name(dev),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "command": " ".join([sys.executable, *sys.argv]),
        "us_per_call": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
