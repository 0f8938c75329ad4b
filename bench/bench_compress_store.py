"""Benchmark the fused compressor step (``kvplan.ops.compress_store``) against the unfused
torch path (gather of the windows, ``pool_windows``, ``store_kv_cache``, two ``index_copy_``
ring writes) for one layer's decode step, side by side in the same run.

Cases (BF16 model, batch ``--batch`` decode rows that all close a window, the worst case):

* ``csa``: a CSA layer's compressor series, entry width 512 (64 rotary dims), ratio 4 with
  overlapping windows (8 rows), V41 FP8 or V41_FP4 cache;
* ``csa-indexer``: the same layer's indexer series, width 128, the index formats;
* ``hca``: an HCA layer's compressor, width 512, ratio 128 (128 rows per window).

Columns: ``unfused`` / ``fused`` median microseconds per step (eager: includes the host's
launch overhead); ``graph`` the same from a CUDA graph of 20 calls (GPU time only);
``err`` the largest difference between the two paths' pooled entries (BF16 steps). The model's
gate bias: ``bias graph`` is the graph time of the torch bias ops (``position_bias[p % r]``,
widen, add) followed by the kernel, then of the kernel given the raw BF16 gate and the bias
table (``GateBias``, the model's path).

    PYTHONPATH=. python3 bench/bench_compress_store.py --out bench/results/compress_store.json
    PYTHONPATH=. python3 bench/bench_compress_store.py --quick    # tiny, runs on a CPU too

On a CPU (``--quick``) the fused column is the Triton interpreter, for debugging only.
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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from kvplan.backends.hybrid.storage import index_format, main_format  # noqa: E402
from kvplan.formats import alloc_kv_cache  # noqa: E402
from kvplan.ops.compress_store import (  # noqa: E402
    GateBias,
    PoolWeights,
    biased_gate,
    compress_store_torch,
    compress_store_triton,
)

# name, series width, rotary dims, ratio, overlap, (kv_format, index kind) per layout
CASES = [
    ("csa", 512, 64, 4, True, [("fp8", None), ("fp4", None)]),
    ("csa-indexer", 128, 64, 4, True, [("fp8", "mxfp8"), ("fp8", "fp8_fp32sf"), ("fp8", "fp4")]),
    ("hca", 512, 64, 128, False, [("fp8", None), ("fp4", None)]),
]
QUICK = [
    ("csa", 64, 16, 4, True, [("fp8", None)]),
    ("hca", 64, 16, 16, False, [("fp4", None)]),
]


def _inputs(width, rd, ratio, overlap, batch, dev, dtype=torch.bfloat16):
    """One decode step: row t (state slot t) closes entry j = 7 from its ring and itself."""
    gen = torch.Generator().manual_seed(0)
    big_r = 2 * ratio if overlap else ratio
    ring_rows = batch * big_r
    kc = (2 if overlap else 1) * width
    kv = torch.randn(batch, kc, generator=gen).to(dtype).to(dev)
    gate = torch.randn(batch, kc, generator=gen).to(dev)
    ring = torch.randn(ring_rows + 1, kc, generator=gen).to(dtype).float().to(dev)
    gring = torch.randn(ring_rows + 1, kc, generator=gen).to(dev)
    t = torch.arange(batch)
    pos_last = 8 * ratio - 1  # the closing row's position
    first = pos_last + 1 - big_r
    col = torch.arange(big_r)
    index = torch.where(col[None, :] < big_r - 1, t[:, None] * big_r + (first + col) % big_r,
                        ring_rows + t[:, None])  # fmt: skip
    store_rows = t * big_r + pos_last % big_r
    positions = torch.full((batch,), 7 * ratio, dtype=torch.int64)
    slots = (t * 3).to(torch.int32)
    weights = PoolWeights(1 + 0.1 * torch.randn(width, generator=gen), 1e-6,
                          torch.rand(rd // 2, generator=gen), 1.0)  # fmt: skip
    args = [kv, gate, ring, gring, index, positions, slots, store_rows, weights]
    return [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args[:8]] + [
        PoolWeights(weights.norm_weight.to(dev), weights.eps, weights.inv_freq.to(dev), 1.0)
    ]


def _time(fn, reps: int) -> float:
    """Median microseconds per call (CUDA: synchronized around each call)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def _graph_time(fn) -> float | None:
    """GPU microseconds per call of 20 calls replayed from one CUDA graph."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 200


def run(cases, batch: int, reps: int) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name, width, rd, ratio, overlap, layouts in cases:
        for kv_format, index_kind in layouts:
            if name.endswith("indexer"):
                layout = index_format(kv_format, index_kind, width, torch.bfloat16)
            else:
                layout = main_format(kv_format, width, torch.bfloat16)
            args = _inputs(width, rd, ratio, overlap, batch, dev)
            cache = alloc_kv_cache(3 * batch, 1, layout, device=dev)
            kw = dict(ratio=ratio, overlap=overlap)
            pooled = torch.zeros(batch, width, device=dev)
            want = compress_store_torch(*args, cache, layout, **kw)
            compress_store_triton(*args, cache, layout, **kw, pooled_out=pooled)
            err = float((pooled - want.float()).abs().max())

            def unfused(args=args, cache=cache, layout=layout, kw=kw):
                compress_store_torch(*args, cache, layout, **kw)

            def fused(args=args, cache=cache, layout=layout, kw=kw):
                compress_store_triton(*args, cache, layout, **kw, state_in_launch=True)

            raw = args[1].to(torch.bfloat16)  # the gate projection, before its bias
            gen = torch.Generator().manual_seed(1)
            bias = GateBias(torch.randn(ratio, raw.shape[1], generator=gen).to(dev),
                            torch.full((batch,), 8 * ratio - 1, device=dev))  # fmt: skip

            def prebias(args=args, cache=cache, layout=layout, kw=kw, raw=raw, bias=bias):
                gate = biased_gate(raw, bias)
                compress_store_triton(args[0], gate, *args[2:], cache, layout, **kw,
                                      state_in_launch=True)  # fmt: skip

            def inbias(args=args, cache=cache, layout=layout, kw=kw, raw=raw, bias=bias):
                compress_store_triton(args[0], raw, *args[2:], cache, layout, **kw,
                                      state_in_launch=True, gate_bias=bias)  # fmt: skip

            row = dict(case=name, layout=layout.note, width=width, ratio=ratio, batch=batch,
                       unfused_us=_time(unfused, reps), fused_us=_time(fused, reps),
                       unfused_graph_us=_graph_time(unfused), fused_graph_us=_graph_time(fused),
                       prebias_graph_us=_graph_time(prebias), inbias_graph_us=_graph_time(inbias),
                       max_err=err)  # fmt: skip
            if dev.type == "cpu":
                inbias()  # runs once even without a graph
            rows.append(row)
            g, ug = row["fused_graph_us"], row["unfused_graph_us"]
            graph = "-" if g is None else f"{ug:.1f} -> {g:.1f}"
            pb, ib = row["prebias_graph_us"], row["inbias_graph_us"]
            bias_graph = "-" if pb is None else f"{pb:.1f} -> {ib:.1f}"
            print(f"{name:12s} {layout.note[:28]:28s} unfused {row['unfused_us']:9.1f} us  "
                  f"fused {row['fused_us']:9.1f} us  graph {graph} us  "
                  f"bias graph {bias_graph} us  err {err:.2e}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", help="append a JSON record to this file")
    a = ap.parse_args()
    cases, batch, reps = (QUICK, 2, 2) if a.quick else (CASES, a.batch, a.reps)
    rows = run(cases, batch, reps)
    if a.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
        record = dict(date=datetime.date.today().isoformat(), device=device or "cpu",
                      command=shlex.join([sys.executable, *sys.argv]), rows=rows)  # fmt: skip
        with open(a.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
