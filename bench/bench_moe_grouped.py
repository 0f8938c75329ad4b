"""Routed MoE experts: grouped vs dense vs sparse, at decode- and prefill-sized batches.

Shapes (GPU mode): hidden 2048; T in (32, 256); (E, width, top-k) in (16, 1024, 2) and
(256, 2048, 8); bf16 activations and weights, random routing (distinct experts per row).

* ``grouped``: `kvplan.ops.moe_grouped.moe_grouped` (device-side grouping, two grouped GEMMs,
  a per-token combine; no host sync);
* ``dense``: every expert on every row (`DeepseekV4MoE.experts_batched` kernels: one GEMM, the
  SwiGLU, one batched GEMM, the weighted sum);
* ``sparse``: `DeepseekV4MoE.experts_sparse` (gathers each routed expert's rows; host sync).

Reported per case and path: median milliseconds per call (CUDA events, eager), and for
grouped / dense also replayed as a CUDA graph; the largest absolute difference to sparse.
A dense case whose ``[E, T, width]`` intermediates would exceed ``--dense-max-gib`` is skipped.

GPU:  PYTHONPATH=. python3 bench/bench_moe_grouped.py --out moe_grouped.json
CPU:  PYTHONPATH=. python3 bench/bench_moe_grouped.py --quick   (tiny shapes, Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported
    os.environ["KVPLAN_FORCE_TRITON"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvplan.models.deepseek_v4.moe import DeepseekV4MoE  # noqa: E402
from kvplan.ops.moe_grouped import moe_grouped  # noqa: E402

LIMIT = 10.0


def _case(t, e, width, k, hidden, dtype, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen).to(dev, dtype)
    gate_up = (torch.randn(e, 2 * width, hidden, generator=gen) * hidden**-0.5).to(dev, dtype)
    down = (torch.randn(e, hidden, width, generator=gen) * width**-0.5).to(dev, dtype)
    ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k].to(dev)
    w = torch.rand(t, k, generator=gen).to(dev, dtype)
    dense = torch.zeros(t, e, dtype=torch.float32, device=dev).scatter_add_(1, ids, w.float())
    moe = SimpleNamespace(gate_up=gate_up, down=down, limit=LIMIT)
    return x, ids, w, dense, moe


def _time(fn, reps, graph):
    """Median ms per call (CUDA events; wall clock on CPU)."""
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    call = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        call = g.replay
    call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _paths(x, ids, w, dense, moe, with_dense):
    """name -> a call of that expert path on one case."""
    paths = {
        "sparse": lambda: DeepseekV4MoE.experts_sparse(moe, x, ids, w),
        "grouped": lambda: moe_grouped(x, ids, w, moe.gate_up, moe.down, LIMIT),
    }
    if with_dense:
        paths["dense"] = lambda: DeepseekV4MoE.experts_batched(moe, x, dense)
    return paths


def run(cases, hidden, dtype, reps, dense_max_gib):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    rows = []
    for t, e, width, k in cases:
        x, ids, w, dense, moe = _case(t, e, width, k, hidden, dtype, dev)
        with torch.no_grad():
            dense_gib = e * t * (3 * width + hidden) * x.element_size() / 2**30
            paths = _paths(x, ids, w, dense, moe, dense_gib <= dense_max_gib)
            ref = paths["sparse"]().float()
            row = dict(T=t, E=e, width=width, top_k=k, hidden=hidden, dtype=str(dtype))
            for name, fn in paths.items():
                row[f"{name}_ms"] = _time(fn, reps, graph=False)
                if cuda and name != "sparse":
                    row[f"{name}_graph_ms"] = _time(fn, reps, graph=True)
                if name != "sparse":
                    row[f"{name}_max_abs_diff"] = float((fn().float() - ref).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU / interpreter)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dense-max-gib", type=float, default=8.0)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.quick:
        cases = [(t, e, 32, k) for t in (2, 9) for e, k in ((4, 2), (16, 3))]
        rows = run(cases, 48, torch.float32, 2, args.dense_max_gib)
    else:
        shapes = ((16, 1024, 2), (256, 2048, 8))
        cases = [(t, e, width, k) for t in (32, 256) for e, width, k in shapes]
        rows = run(cases, 2048, torch.bfloat16, args.reps, args.dense_max_gib)
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, quick=args.quick)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
