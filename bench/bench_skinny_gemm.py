"""Split-K Triton GEMM (`kvplan.ops.skinny_gemm`) vs cuBLAS (`F.linear`) at decode row counts.

For every projection shape of the benchmark models (the random llama-1b of bench_engine.py and
the DeepSeek-V4 shape of bench_hybrid.py, each ``nn.Linear`` of one layer of each kind, found on
the meta device) and every row count of ``--rows``, times ``F.linear`` and the Triton op under
each candidate `SkinnyTiles` as CUDA-graph replays of ``--calls`` back-to-back calls (so
launch gaps count as they do inside the engine's decode graphs), and reports the fastest
candidate, its speedup over cuBLAS and the bandwidth both reach (weight bytes / time). Every
candidate's result is checked against cuBLAS first (max |diff| / max |y|).

    PYTHONPATH=. python3 bench/bench_skinny_gemm.py --out results.json          # H200
    PYTHONPATH=. python3 bench/bench_skinny_gemm.py --quick --out /tmp/q.json   # CPU smoke

The CPU run (``--quick``: two small shapes, the Triton interpreter) checks the script only;
its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
from torch import nn

from kvplan.ops.skinny_gemm import SkinnyTiles, skinny_linear, skinny_plan

CANDIDATES = [
    SkinnyTiles(64, 128, None, 4, 3),
    SkinnyTiles(64, 128, None, 4, 4),
    SkinnyTiles(128, 64, None, 4, 4),
    SkinnyTiles(128, 128, None, 8, 3),
    SkinnyTiles(32, 256, None, 4, 3),
    SkinnyTiles(64, 256, None, 4, 2),
    SkinnyTiles(32, 128, None, 4, 4),
    SkinnyTiles(16, 256, None, 4, 3),
]


def model_shapes() -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of every GEMM in one layer of each kind of the two benchmark models
    (built on the meta device): each ``LinearGroup`` as its one fused GEMM, every other
    ``nn.Linear`` (routed experts aside), the LM heads."""
    from bench_hybrid import model_config

    from kvplan.backends import get_backend
    from kvplan.models.config import named_config
    from kvplan.models.deepseek_v4 import DeepseekV4ForCausalLM
    from kvplan.models.deepseek_v4.layers import LinearGroup
    from kvplan.models.llama import LlamaForCausalLM

    shapes: dict[str, tuple[int, int]] = {}
    with torch.device("meta"):
        llama = LlamaForCausalLM(
            named_config("llama-1b"), get_backend("block_offsets"), max_positions=16
        )
        dsv4 = DeepseekV4ForCausalLM(model_config(False))
    for prefix, model in (("llama", llama), ("dsv4", dsv4)):
        grouped = set()
        for name, mod in model.named_modules():  # LinearGroups: one GEMM over their members
            if isinstance(mod, LinearGroup):
                grouped.update(id(m) for m in mod._members)
                parts = name.split(".")
                if "layers" in parts:
                    i = parts.index("layers")
                    name = ".".join(parts[:i] + parts[i + 2 :])
                n, k = sum(mod.sizes), mod._members[0].in_features
                shapes.setdefault(f"{prefix}:{name} {n}x{k}", (n, k))
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or "experts" in name or id(mod) in grouped:
                continue
            parts = name.split(".")
            if "layers" in parts:  # one layer of each index's kind: keep the first of a name
                i = parts.index("layers")
                name = ".".join(parts[:i] + parts[i + 2 :])
            n, k = mod.weight.shape
            shapes.setdefault(f"{prefix}:{name} {n}x{k}", (n, k))
    return shapes


def graph_time(fn, calls: int, dev: torch.device) -> float:
    """Microseconds per call: on CUDA ``calls`` calls replayed from one CUDA graph
    (``bench_index_ops.graph_time_s``); on the CPU (the smoke run) plain calls."""
    if dev.type == "cuda":
        from bench_index_ops import graph_time_s

        return graph_time_s(fn, calls) * 1e6
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64", help="row counts (comma-separated)")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: two small shapes")
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds; then stop")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.quick:
        shapes, rows_list, cands = {"a": (48, 64), "b": (40, 96)}, [4], [SkinnyTiles(16, 32)]
        calls = 1
    else:
        shapes, cands, calls = model_shapes(), CANDIDATES, args.calls
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    t_start, results = time.perf_counter(), []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in sorted(shapes.items(), key=lambda kv: kv[1]):
        w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(dtype)
        for m in rows_list:
            if time.perf_counter() - t_start > args.time_budget:
                print(f"time budget spent: stopped before {name} x {m}", file=sys.stderr)
                break
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            ref = torch.nn.functional.linear(x, w)
            scale = ref.abs().max().item() or 1.0
            row = dict(shape=name, n=n, k=k, rows=m, weight_bytes=w.numel() * w.element_size())
            row["cublas_us"] = graph_time(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), calls, dev
            )
            best = None
            for tiles in cands:
                try:
                    diff = (skinny_linear(x, w, tiles=tiles).float() - ref.float()).abs().max()
                    us = graph_time(
                        lambda x=x, w=w, t=tiles: skinny_linear(x, w, tiles=t), calls, dev
                    )
                except Exception as exc:  # e.g. out of shared memory: report, keep going
                    print(f"  {name} x {m} {tiles}: {type(exc).__name__}", file=sys.stderr)
                    continue
                splits = skinny_plan(n, k, sms, tiles)[1]
                cand = dict(tiles=repr(tiles), splits=splits, us=us, rel_diff=diff.item() / scale)
                row.setdefault("candidates", []).append(cand)
                if best is None or us < best["us"]:
                    best = cand
            if best is not None:
                row["best"] = best
                row["speedup"] = row["cublas_us"] / best["us"]
                row["cublas_GBps"] = row["weight_bytes"] / row["cublas_us"] / 1e3
                row["best_GBps"] = row["weight_bytes"] / best["us"] / 1e3
                print(
                    f"{name:40s} {n:6d} x {k:5d} M={m:3d}: cuBLAS {row['cublas_us']:7.1f} us "
                    f"({row['cublas_GBps']:6.0f} GB/s), Triton {best['us']:7.1f} us "
                    f"({row['best_GBps']:6.0f} GB/s) {row['speedup']:.2f}x  {best['tiles']} "
                    f"splits {best['splits']} diff {best['rel_diff']:.1e}"
                )
            results.append(row)
    out = {
        "bench": "skinny_gemm",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "command": "python " + " ".join(sys.argv),
        "dtype": str(dtype),
        "calls_per_graph": calls,
        "rows": results,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
