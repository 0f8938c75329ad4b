"""Greedy sampling's argmax over a decode step's logits, side by side in one run.

For each ``rows x vocab`` (the dense bench's 64 x 128,256 and the hybrid bench's 32 x 129,280
by default), bf16 logits as the LM head writes them:

* ``copy+torch``: the engine before session 14, the model's fp32 copy then torch's argmax;
* ``torch bf16``: torch's argmax on the bf16 logits;
* ``kvplan bf16`` / ``kvplan fp32``: `kvplan.ops.argmax.argmax_rows` on the bf16 logits / on
  their fp32 copy (the copy not timed);
* ``kvplan splits=S``: ``--sweep`` only, other part counts.

Each path is checked equal to torch's argmax of the fp32 copy. Timings: CUDA-graph replay
medians (`bench_sparse_kernels.graph_ms`) and eager medians.

``--lm-head`` (CUDA only): the LM head with the argmax fused into it instead, for each
``rows x vocab x hidden`` of ``--head-shapes`` (default the llama-1b head at batch 64 and
the DeepSeek-V4 bench's at 32), bf16, the weight read from DRAM (larger than the L2 cache):

* ``small_linear``: `kvplan.ops.small_gemm.small_linear`, logits only;
* ``small_linear+argmax``: ``argmax_out=`` (the kernel's per-tile argmax + the merge);
* ``argmax_rows``: the separate argmax of the stored logits (what the fused path replaces);
* ``small_linear, argmax_rows``: the two launches of the unfused path.

The fused tokens are checked equal to ``logits.argmax(-1)`` and the logits to the plain call's.

    PYTHONPATH=. python3 bench/bench_argmax.py [--shapes 64x128256,32x129280] [--sweep]
    PYTHONPATH=. python3 bench/bench_argmax.py --lm-head [--head-shapes 64x128256x2048]
        [--head-plans 256x64x8x4,128x64x4x6]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
from bench_sparse_kernels import graph_ms, timed_ms

from kvplan.ops.argmax import argmax_rows, argmax_rows_triton
from kvplan.ops.small_gemm import (
    small_gemm_plan,
    small_linear,
    small_linear_triton,
    small_linear_wanted,
)


def lm_head_rows(shapes: str, dev: torch.device, plans: str = "") -> list[dict]:
    """``--lm-head``: the rows of the table (module docstring) for each ``MxVxK`` of
    ``shapes``, and ``small_linear_triton`` with and without the fused argmax for each
    ``BLOCK_NxBLOCK_KxWARPSxSTAGES`` of ``plans`` (comma-separated)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for shape in shapes.split(","):
        m, v, k = (int(s) for s in shape.split("x"))
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        w = (torch.randn(v, k, generator=gen, device=dev) * k**-0.5).to(torch.bfloat16)
        if not small_linear_wanted(x, w):
            raise SystemExit(f"--head-shapes: {shape} does not run small_linear's kernel")
        tokens = torch.empty(m, dtype=torch.int64, device=dev)
        logits = small_linear(x, w)
        fused_logits = small_linear(x, w, argmax_out=tokens)
        ok = torch.equal(fused_logits, logits) and torch.equal(tokens, logits.argmax(dim=-1))
        paths = {
            "small_linear": lambda x=x, w=w: small_linear(x, w),
            "small_linear+argmax": lambda x=x, w=w, t=tokens: small_linear(x, w, argmax_out=t),
            "argmax_rows": lambda y=logits: argmax_rows(y),
            "small_linear, argmax_rows": lambda x=x, w=w: argmax_rows(small_linear(x, w)),
        }
        for spec in plans.split(",") if plans else ():  # other tiles, with and without
            bn, bk, warps, stages = (int(t) for t in spec.split("x"))
            plan = small_gemm_plan(m, block_n=bn, block_k=bk, num_warps=warps,
                                   num_stages=stages)  # fmt: skip
            paths[f"plan {spec}"] = lambda x=x, w=w, p=plan: small_linear_triton(x, w, p)
            paths[f"plan {spec}+argmax"] = lambda x=x, w=w, p=plan, t=tokens: (
                small_linear_triton(x, w, p, argmax_out=t))  # fmt: skip
        for name, fn in paths.items():
            row = {"shape": f"{m}x{v}x{k}", "path": name, "equal": ok,
                   "ms": timed_ms(fn, dev), "graph_ms": graph_ms(fn, dev)}  # fmt: skip
            rows_out.append(row)
            print(f"{row['shape']:>16} {name:<26} eager {row['ms'] * 1e3:8.1f} us  graph "
                  f"{row['graph_ms'] * 1e3:8.1f} us  equal {ok}")  # fmt: skip
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x128256,32x129280")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--lm-head", action="store_true", help="the fused LM-head argmax (CUDA)")
    ap.add_argument("--head-shapes", default="64x128256x2048,32x129280x2048")
    ap.add_argument("--head-plans", default="", help="extra tiles BNxBKxWARPSxSTAGES,...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.lm_head:
        if dev.type != "cuda":
            print("bench_argmax --lm-head needs a CUDA device", file=sys.stderr)
            return 1
        rows_out = lm_head_rows(args.head_shapes, dev, args.head_plans)
        return _finish(args, dev, "argmax_lm_head", rows_out)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        n, v = (int(s) for s in shape.split("x"))
        if dev.type == "cpu":
            n, v = min(n, 4), min(v, 4096)
        logits = (torch.randn(n, v, generator=gen, device=dev) * 3).to(torch.bfloat16)
        wide = logits.float()
        want = wide.argmax(dim=-1)
        paths = {
            "copy+torch": lambda x=logits: x.float().argmax(dim=-1),
            "torch bf16": lambda x=logits: x.argmax(dim=-1),
            "kvplan bf16": lambda x=logits: argmax_rows(x),
            "kvplan fp32": lambda x=wide: argmax_rows(x),
        }
        if args.sweep and dev.type == "cuda":
            for s in (1, 2, 4, 8, 16, 32):
                paths[f"kvplan splits={s}"] = lambda x=logits, s=s: argmax_rows_triton(x, splits=s)
        for name, fn in paths.items():
            ok = torch.equal(fn(), want)
            row = {"shape": f"{n}x{v}", "path": name, "equal": ok,
                   "ms": timed_ms(fn, dev), "graph_ms": graph_ms(fn, dev)}  # fmt: skip
            rows_out.append(row)
            g = row["graph_ms"]
            print(f"{row['shape']:>12} {name:<18} eager {row['ms'] * 1e3:8.1f} us  graph "
                  f"{'-' if g is None else f'{g * 1e3:8.1f}'} us  equal {ok}")  # fmt: skip
    return _finish(args, dev, "argmax", rows_out)


def _finish(args: argparse.Namespace, dev: torch.device, bench: str, rows_out: list) -> int:
    """Write the JSON record (``--out``); exit status 1 when a path's check failed."""
    record = {
        "bench": bench,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "command": " ".join(sys.argv),
        "rows": rows_out,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if all(r["equal"] for r in rows_out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
