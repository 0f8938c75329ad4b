"""Few-row GEMMs: `kvplan.ops.small_gemm.small_linear_triton` against cuBLAS (``F.linear``).

For each shape ``M x N x K`` (token rows x weight rows x input width, bf16) the weight is
streamed as in a decode step: a CUDA graph runs the GEMM over enough copies of the weight to
exceed the L2 cache (256 MB of weights), and a call's time is the replay's over the copies
(median of ``--reps`` replays). Every plan of the grid (weight rows a program, K step, pipeline
stages, warps) is checked against the fp32 product and for run-to-run equality, then timed; the table gives cuBLAS, the default plan and the best plan, with bandwidths.

Usage::

    PYTHONPATH=. python3 bench/bench_small_gemm.py --out bench/results/h200/small_gemm.json
    PYTHONPATH=. python3 bench/bench_small_gemm.py --shapes 64,2048,2048 --grid default
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvplan.ops import small_gemm as sg

# LM heads: llama-1b at batch 64, the DeepSeek-V4 bench at 32, SmolLM2, Gemma-3; then two of
# the narrow decode GEMMs that stay on cuBLAS (llama-1b's o and down projections)
DEFAULT_SHAPES = (
    "64,128256,2048,llama_head",
    "32,129280,2048,dsv4_head",
    "64,49152,576,smollm2_head",
    "64,262144,640,gemma3_head",
    "64,2048,2048,o",
    "64,2048,8192,down",
)
# (weight rows a program, K step, stages, warps)
GRID = ((64, 128, 4, 4), (128, 128, 4, 4), (128, 64, 6, 4), (128, 128, 3, 8), (256, 64, 4, 8),
        (64, 256, 3, 4),
        # narrow weights (a few thousand rows): more programs than SMs
        (16, 256, 4, 4), (16, 512, 3, 4), (32, 256, 4, 4), (32, 128, 6, 4))  # fmt: skip


def parse_shape(text: str) -> tuple[int, int, int, str]:
    parts = text.split(",")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--shapes: {text!r} is not M,N,K[,name]")
    m, n, k = (int(p) for p in parts[:3])
    return m, n, k, parts[3] if len(parts) == 4 else f"{m}x{n}x{k}"


def graph_time(calls, reps: int) -> float:
    """Median seconds of one replay of a graph that runs every callable in ``calls`` once."""
    for c in calls:  # compile / warm up outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def streamed_weights(n, k, weight_mb, dev, gen, scale=1.0) -> list[torch.Tensor]:
    """Copies of a random bf16 ``[n, k]`` weight (``N(0, scale^2)``), enough (1-64) for
    ``weight_mb`` MB, so that a graph over them streams its weights from DRAM, not L2."""
    copies = max(1, min(64, math.ceil(weight_mb * 2**20 / (n * k * 2))))
    return [(torch.randn(n, k, device=dev, generator=gen) * scale).to(torch.bfloat16)
            for _ in range(copies)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES))
    ap.add_argument("--grid", choices=("full", "default"), default="full")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--weight-mb", type=float, default=256.0, help="weights streamed a replay")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_small_gemm needs a CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}")
    print(f"{'shape':>22} {'cuBLAS us':>9} {'GB/s':>6} {'default us':>10} {'best us':>8} {'GB/s':>6}"
          f" {'best/cuBLAS':>11}  best plan")  # fmt: skip
    for spec in args.shapes:
        m, n, k, name = parse_shape(spec)
        wbytes = n * k * 2
        ws = streamed_weights(n, k, args.weight_mb, dev, gen)
        copies = len(ws)
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = (x.float() @ ws[0].float().T).cpu()
        scale = ref.abs().max().item()
        cublas = graph_time([lambda w=w, x=x: F.linear(x, w) for w in ws], args.reps) / copies
        plans = [("default", sg.small_gemm_plan(m))]
        if args.grid == "full":
            for bn, bk, st, wp in GRID:
                p = sg.small_gemm_plan(m, block_n=bn, block_k=bk, num_stages=st, num_warps=wp)
                if p not in [q for _, q in plans]:
                    plans.append((f"{bn}x{bk}s{st}w{wp}", p))
        results = []
        for label, plan in plans:
            try:
                out = sg.small_linear_triton(x, ws[0], plan)
                again = sg.small_linear_triton(x, ws[0], plan)
                torch.cuda.synchronize()
                err = (out.float().cpu() - ref).abs().max().item() / scale
                same = torch.equal(out, again)
                t = graph_time([lambda w=w, p=plan, x=x: sg.small_linear_triton(x, w, p) for w in ws],
                               args.reps) / copies  # fmt: skip
            except Exception as e:  # noqa: BLE001 (out of shared memory etc.: skip the plan)
                print(f"  {name} {label}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            ok = err < 2e-2 and same
            results.append({"label": label, "plan": plan._asdict(), "us": t * 1e6,
                            "rel_err": err, "deterministic": same, "ok": ok})  # fmt: skip
            if not ok:
                print(f"  {name} {label}: WRONG (rel err {err:.2e}, deterministic {same})")
        good = [r for r in results if r["ok"]]
        best = min(good, key=lambda r: r["us"]) if good else None
        default = next((r for r in results if r["label"] == "default"), None)
        row = {"name": name, "m": m, "n": n, "k": k, "cublas_us": cublas * 1e6,
               "default": default, "best": best, "plans": results}  # fmt: skip
        rows.append(row)
        d_us = f"{default['us']:.1f}" if default else "-"
        if best:
            print(f"{name + f' {m}x{n}x{k}':>22} {cublas * 1e6:9.1f} {wbytes / cublas / 1e9:6.0f} "
                  f"{d_us:>10} {best['us']:8.1f} {wbytes / best['us'] / 1e3:6.0f} "
                  f"{cublas * 1e6 / best['us']:11.2f}  {best['label']}")  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    if args.out:
        save_rows(args.out, dev, rows)


def save_rows(path: str, dev: torch.device, rows: list[dict]) -> None:
    """Write ``rows`` as JSON with the device, torch version, date and command."""
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(sys.argv)}  # fmt: skip
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
