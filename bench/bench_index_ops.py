"""Benchmark the index ops against a device-to-device copy of the same output size.

For each op at ``--rows`` query rows it times, in the same run and on the same device:
the Triton kernel (``*_triton``, ``out=`` preallocated, ``check=False`` as planning calls
it), the plain-torch path (``*_torch``), and ``dst.copy_(src)`` of a tensor as large as the
op's output. Effective bandwidth = (bytes read + bytes written) / median time; the ratio is
that bandwidth over the copy's (2 x output bytes / its median time). Each case also checks that
the Triton result equals the torch result bit for bit.

    PYTHONPATH=. python3 bench/bench_index_ops.py --out bench/results/index_ops.json
    PYTHONPATH=. python3 bench/bench_index_ops.py --quick          # tiny, runs on a CPU too

On CUDA, times come from ``triton.testing.do_bench`` (L2 flushed before every call, median;
this "eager" time includes any host launch cost the GPU waits for) and, for the kernel and the
copy, from a CUDA graph of 20 back-to-back calls (the "graph" columns: GPU time per call with
no host overhead; the ratio there compares kernel and copy measured the same way).
On a CPU (``--quick``) the "triton" column is the interpreter, for debugging only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import triton  # noqa: E402

from kvplan.ops.convert_kv_index import convert_kv_index_torch, convert_kv_index_triton  # noqa: E402
from kvplan.ops.kv_ca_index import (  # noqa: E402
    expand_kv_ca_index_decode_torch,
    expand_kv_ca_index_decode_triton,
    expand_kv_ca_index_torch,
    expand_kv_ca_index_triton,
    kv_ca_index_width,
)
from kvplan.ops.kv_index_cat import kv_index_cat_torch, kv_index_cat_triton  # noqa: E402
from kvplan.ops.swa_index import (  # noqa: E402
    expand_swa_index_decode_torch,
    expand_swa_index_decode_triton,
    expand_swa_index_torch,
    expand_swa_index_triton,
)

I32 = 4  # bytes per int32


def median_time_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def graph_time_s(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU time per call of ``calls`` back-to-back calls replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (compiles, allocations)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return (
        triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
        * 1e-3
        / calls
    )


def warm_up_gpu(seconds: float = 1.5) -> None:
    """Raise the SM clock from idle before timing (the first case ran at idle clocks)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def make_cases(rows: int, window: int, topk: int, ca_len: int, device: torch.device, seed: int):
    """(name, width, bytes moved, triton fn, torch fn) per op; inputs random but valid."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(torch.int32)

    cases = []
    # expand_swa_index: P1 + P3 <= W
    p1 = randint(0, window + 1, (rows,))
    p3 = (torch.rand(rows, generator=g) * (window - p1 + 1)).long().to(torch.int32)
    piv = torch.stack([randint(0, 1 << 20, (rows,)), p1, randint(0, 1 << 20, (rows,)), p3], 1)
    piv = piv.to(device)
    out = torch.empty(rows, window, dtype=torch.int32, device=device)
    cases.append((
        "expand_swa_index", window, rows * 4 * I32 + out.numel() * I32,
        lambda: expand_swa_index_triton(piv, window, out=out, check=False),
        lambda: expand_swa_index_torch(piv, window, out=out, check=False),
    ))  # fmt: skip
    # expand_swa_index_decode: ring = window + 64
    ring = window + 64
    ol = torch.stack([randint(0, 1000, (rows,)) * ring + randint(0, ring, (rows,)),
                      randint(0, window + 1, (rows,))], 1).to(device)  # fmt: skip
    out_d = torch.empty(rows, window, dtype=torch.int32, device=device)
    cases.append((
        "expand_swa_index_decode", window, rows * 2 * I32 + out_d.numel() * I32,
        lambda: expand_swa_index_decode_triton(ol, window, ring, out=out_d, check=False),
        lambda: expand_swa_index_decode_torch(ol, window, ring, out=out_d, check=False),
    ))  # fmt: skip
    # kv_index_cat: [rows, W] SWA index + [rows, topk] compressed index
    swa = randint(-1, 1 << 20, (rows, window)).to(device)
    ca = randint(-1, 1 << 20, (rows, topk)).to(device)
    out_c = torch.empty(rows, window + topk, dtype=torch.int32, device=device)
    cases.append((
        "kv_index_cat", window + topk, 2 * out_c.numel() * I32,
        lambda: kv_index_cat_triton(swa, ca, 4096, out=out_c, check=False),
        lambda: kv_index_cat_torch(swa, ca, 4096, out=out_c, check=False),
    ))  # fmt: skip
    # expand_kv_ca_index (prefill): lengths up to ca_len
    width = kv_ca_index_width(ca_len)
    ol_c = torch.stack([randint(0, 1 << 20, (rows,)), randint(0, ca_len + 1, (rows,))], 1)
    ol_c = ol_c.to(device)
    out_k = torch.empty(rows, width, dtype=torch.int32, device=device)
    cases.append((
        "expand_kv_ca_index", width, rows * 2 * I32 + out_k.numel() * I32,
        lambda: expand_kv_ca_index_triton(ol_c, ca_len, out=out_k, check=False),
        lambda: expand_kv_ca_index_torch(ol_c, ca_len, out=out_k, check=False),
    ))  # fmt: skip
    # expand_kv_ca_index_decode: per-row block tables, 16 compressed tokens per block
    tpb = 16
    num_blocks = -(-ca_len // tpb)
    bt = randint(0, 1 << 16, (rows, num_blocks)).to(device)
    ol_d = torch.stack([torch.zeros(rows, dtype=torch.int32), randint(0, ca_len + 1, (rows,))], 1)
    ol_d = ol_d.to(device)
    out_kd = torch.empty(rows, width, dtype=torch.int32, device=device)
    cases.append((
        "expand_kv_ca_index_decode", width, rows * 2 * I32 + bt.numel() * I32 + out_kd.numel() * I32,
        lambda: expand_kv_ca_index_decode_triton(ol_d, bt, 64, 4, ca_len, out=out_kd, check=False),
        lambda: expand_kv_ca_index_decode_torch(ol_d, bt, 64, 4, ca_len, out=out_kd, check=False),
    ))  # fmt: skip
    # convert_kv_index: topk logical indices over ca_len compressed tokens
    tk = randint(-1, ca_len, (rows, topk)).to(device)
    ctx = randint(0, topk + 1, (rows,)).to(device)
    out_t = torch.empty(rows, topk, dtype=torch.int32, device=device)
    cases.append((
        "convert_kv_index", topk, rows * I32 + 2 * out_t.numel() * I32,
        lambda: convert_kv_index_triton(tk, bt, ctx, tpb, out=out_t, check=False),
        lambda: convert_kv_index_torch(tk, bt, ctx, tpb, out=out_t, check=False),
    ))  # fmt: skip
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--window", type=int, default=128, help="SWA window W")
    parser.add_argument("--topk", type=int, default=512, help="compressed index width")
    parser.add_argument("--ca-len", type=int, default=2048, help="max compressed tokens per row")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU debugging)")
    parser.add_argument("--reps", type=int, default=5, help="CPU repetitions")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.window, args.topk, args.ca_len = 64, 16, 32, 100
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()})"
    )

    if device.type == "cuda":
        warm_up_gpu()
    results = []
    header = (f"{'op':26s} {'rows':>6s} {'width':>6s} {'MB':>8s} {'triton us':>10s} "
              f"{'torch us':>10s} {'copy us':>9s} {'triton/copy':>11s} {'torch/copy':>10s} "
              f"{'graph us':>9s} {'g.copy us':>9s} {'graph ratio':>11s}")  # fmt: skip
    print(f"device: {device_name}; torch {torch.__version__}; triton {triton.__version__}")
    print(header)
    for name, width, nbytes, fn_triton, fn_torch in make_cases(
        args.rows, args.window, args.topk, args.ca_len, device, seed=0
    ):
        exact = torch.equal(fn_triton().clone(), fn_torch().clone())
        out_bytes = args.rows * width * I32
        src = torch.randint(0, 100, (out_bytes // I32,), dtype=torch.int32, device=device)
        dst = torch.empty_like(src)
        t_copy = median_time_s(lambda dst=dst, src=src: dst.copy_(src), device, args.reps)
        t_triton = median_time_s(fn_triton, device, args.reps)
        t_torch = median_time_s(fn_torch, device, args.reps)
        bw_copy = 2 * out_bytes / t_copy
        if device.type == "cuda":
            g_copy = graph_time_s(lambda dst=dst, src=src: dst.copy_(src))
            g_triton = graph_time_s(fn_triton)
        else:
            g_copy, g_triton = t_copy, t_triton
        row = {
            "op": name, "rows": args.rows, "width": width, "bytes": nbytes,
            "t_triton_us": t_triton * 1e6, "t_torch_us": t_torch * 1e6, "t_copy_us": t_copy * 1e6,
            "bw_triton_GBps": nbytes / t_triton / 1e9, "bw_torch_GBps": nbytes / t_torch / 1e9,
            "bw_copy_GBps": bw_copy / 1e9, "ratio_triton_vs_copy": nbytes / t_triton / bw_copy,
            "ratio_torch_vs_copy": nbytes / t_torch / bw_copy, "triton_equals_torch": exact,
            "graph_triton_us": g_triton * 1e6, "graph_copy_us": g_copy * 1e6,
            "graph_ratio_triton_vs_copy": nbytes / g_triton / (2 * out_bytes / g_copy),
        }  # fmt: skip
        results.append(row)
        print(f"{name:26s} {args.rows:6d} {width:6d} {nbytes / 1e6:8.2f} {row['t_triton_us']:10.1f} "
              f"{row['t_torch_us']:10.1f} {row['t_copy_us']:9.1f} "
              f"{row['ratio_triton_vs_copy']:11.2f} {row['ratio_torch_vs_copy']:10.2f} "
              f"{row['graph_triton_us']:9.1f} {row['graph_copy_us']:9.1f} "
              f"{row['graph_ratio_triton_vs_copy']:11.2f}"
              + ("" if exact else "  MISMATCH"))  # fmt: skip
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name,
        "command": "PYTHONPATH=. python3 " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": "eager: triton.testing.do_bench median, L2 flushed; graph: 20 calls per CUDA "
        "graph replay, median per call"
        if device.type == "cuda" else f"perf_counter median of {args.reps}",
        "results": results,
    }  # fmt: skip
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if all(r["triton_equals_torch"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
