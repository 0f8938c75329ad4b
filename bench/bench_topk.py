"""Benchmark ``kvplan.ops.topk.topk_columns`` (one radix-select Triton kernel per row) against
the torch path it replaced (masked_fill + ``torch.topk`` + where + cast), plain and with the
decode lookup of the chosen columns' pool slots (``gather=`` vs ``convert_kv_index``).

Times: median over ``--reps`` calls, each between two CUDA events ("eager", host launch cost
included where the GPU waits for it), and the GPU time per call of 20 back-to-back calls
replayed from one CUDA graph ("graph"). Each case checks that both paths choose the same set
of columns (a mismatch is also reported as "same scores" when only tied columns differ).

    PYTHONPATH=. python3 bench/bench_topk.py --out bench/results/topk_h200.json
    PYTHONPATH=. python3 bench/bench_topk.py --sweep      # + tile x num_warps of the kernel
    PYTHONPATH=. python3 bench/bench_topk.py --quick      # tiny, runs on a CPU (interpreter)
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
from bench_index_ops import graph_time_s  # noqa: E402

from kvplan.ops.convert_kv_index import convert_kv_index  # noqa: E402
from kvplan.ops.topk import topk_columns_triton  # noqa: E402

CASES = [(32, 8192), (32, 32768), (4096, 2048)]  # (rows, candidate columns)
SWEEP = [  # (tile, digit bits, num_warps) of the kernel under --sweep
    *((t, 8, w) for t in (1024, 2048, 4096) for w in (4, 8, 16)),
    (2048, 6, 8), (2048, 5, 8),
]  # fmt: skip


def old_topk_columns(scores: torch.Tensor, count: torch.Tensor, top_k: int) -> torch.Tensor:
    """The torch path ``kvplan.ops.index_scores.topk_columns`` had: best first, -1 after."""
    num_rows, width = scores.shape
    out = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=scores.device)
    col = torch.arange(width, device=scores.device)[None, :]
    scores = scores.masked_fill(col >= count.long()[:, None], float("-inf"))
    k = min(top_k, width)
    picked = scores.topk(k, dim=-1).indices
    keep = torch.arange(k, device=scores.device)[None, :] < count.long()[:, None]
    out[:, :k] = torch.where(keep, picked, -1).to(torch.int32)
    return out


def event_time_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median of ``reps`` calls, each timed by CUDA events (perf_counter on a CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def graph_time_us(fn: Callable[[], object], reps: int, calls: int = 20) -> float:
    """GPU time per call of ``calls`` back-to-back calls replayed from one CUDA graph."""
    return graph_time_s(fn, calls) * 1e6


def same_choice(new: torch.Tensor, old: torch.Tensor, scores: torch.Tensor) -> tuple[bool, bool]:
    """(same column sets, same multisets of chosen scores) per row."""
    big = scores.shape[1]
    a = torch.where(new >= 0, new, big).long().sort(dim=1).values
    b = torch.where(old >= 0, old, big).long().sort(dim=1).values
    padded = torch.nn.functional.pad(scores, (0, 1), value=float("nan"))
    sa = padded.gather(1, a).sort(dim=1).values
    sb = padded.gather(1, b).sort(dim=1).values
    return torch.equal(a, b), torch.equal(sa.nan_to_num(-1.0), sb.nan_to_num(-1.0))


def run_case(num_rows, width, top_k, reps, sweep, device, gen) -> list[dict]:
    """Time and check every variant on one random ``[num_rows, width]`` case; print rows."""
    scores = torch.randn(num_rows, width, generator=gen).relu().to(device)  # many small scores
    scores += torch.rand(num_rows, width, generator=gen).to(device) * 1e-3
    count = torch.randint(width // 2, width + 1, (num_rows,), generator=gen)
    count = count.to(torch.int32).to(device)
    tpb = 64  # candidate column -> pool slot through a shuffled block table
    blocks = -(-width // tpb)
    table = torch.randperm(num_rows * blocks, generator=gen).view(num_rows, blocks)
    table = table.to(torch.int32).to(device)
    col = torch.arange(width, dtype=torch.int32, device=device)[None, :].expand(num_rows, -1)
    cand = torch.where(col < count[:, None], col, -1).contiguous()
    slots = convert_kv_index(cand, table, count, tpb, out=torch.empty_like(cand))

    def old_columns():
        return old_topk_columns(scores, count, top_k)

    variants = [
        ("columns", lambda: topk_columns_triton(scores, count, top_k), old_columns),
        ("slots (gather)", lambda: topk_columns_triton(scores, count, top_k, gather=slots),
         lambda: convert_kv_index(old_columns(), table, count, tpb, check=False)),
    ]  # fmt: skip
    if sweep and device.type == "cuda":
        for tile, bits, warps in SWEEP:
            variants.append((f"columns t{tile} b{bits} w{warps}",
                             lambda t=tile, b=bits, w=warps: topk_columns_triton(
                                 scores, count, top_k, tile=t, bits=b, num_warps=w),
                             old_columns))  # fmt: skip
    rows = []
    for label, new_fn, old_fn in variants:
        new, old = new_fn(), old_fn()
        if label.startswith("slots"):
            same_set = torch.equal(
                torch.where(new >= 0, new, 2**31 - 1).sort(dim=1).values,
                torch.where(old >= 0, old, 2**31 - 1).sort(dim=1).values,
            )
            same_scores = same_set
        else:
            same_set, same_scores = same_choice(new, old, scores)
        t_new = event_time_us(new_fn, device, reps)
        t_old = event_time_us(old_fn, device, reps)
        g_new = graph_time_us(new_fn, reps) if device.type == "cuda" else t_new
        g_old = graph_time_us(old_fn, reps) if device.type == "cuda" else t_old
        check = "same set" if same_set else ("same scores" if same_scores else "MISMATCH")
        print(f"{num_rows:5d} {width:6d} {label:24s} {t_new:8.1f} {t_old:8.1f} "
              f"{g_new:9.1f} {g_old:9.1f}  {check}")  # fmt: skip
        rows.append({
            "rows": num_rows, "width": width, "top_k": top_k, "variant": label,
            "new_us": t_new, "old_us": t_old, "new_graph_us": g_new, "old_graph_us": g_old,
            "same_set": same_set, "same_scores": same_scores,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, default=512)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time tile x num_warps")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU debugging)")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    cases = [(3, 300), (2, 700)] if args.quick else CASES
    top_k = 40 if args.quick else args.top_k
    reps = 3 if args.quick else args.reps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()})"
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"top_k {top_k}")  # fmt: skip
    print(f"{'rows':>5s} {'width':>6s} {'variant':24s} {'new us':>8s} {'old us':>8s} "
          f"{'new graph':>9s} {'old graph':>9s}  check")  # fmt: skip
    results = []
    gen = torch.Generator().manual_seed(0)
    for num_rows, width in cases:
        results += run_case(num_rows, width, top_k, reps, args.sweep, device, gen)
    ok = all(r["same_scores"] for r in results)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "command": "PYTHONPATH=. python3 " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": f"median of {reps} calls between CUDA events; graph: 20 calls per replay"
        if device.type == "cuda" else f"perf_counter median of {reps}",
        "results": results,
    }  # fmt: skip
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
