"""A decode step's dense MoE: `kvplan.ops.moe_decode`'s two kernels against the cuBLAS path.

Shapes of the DeepSeek-V4 bench model (`bench/bench_hybrid.py`): 16 routed experts and the
shared one, I = 1,024, H = 2,048, the router's 16 rows; bf16. For each batch ``T`` a CUDA
graph runs ``--layers`` copies of the layer's weights in turn (more bytes than the L2 cache,
as a decode step streams them) and a layer's time is the replay's over the copies (median of
``--reps`` replays). Two halves are timed apart and together:

- gate / up: ``F.linear`` with the fused weight then `moe_swiglu` (cuBLAS + one kernel)
  against `moe_gate_up_swiglu` (one kernel), for every plan of ``GATE_UP_GRID``;
- down: ``torch.bmm`` then `expert_weighted_sum` against `moe_down_sum`, for ``DOWN_GRID``;
- both: the four launches against the two kernels at their default plans.

Each plan's output is checked against the cuBLAS path (bf16 tolerance) before it is timed.

Usage::

    PYTHONPATH=. python3 bench/bench_moe_decode.py --out bench/results/h100/moe_decode.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F
from bench_small_gemm import graph_time

from kvplan.ops import moe_decode as md
from kvplan.ops.moe_dense import expert_weighted_sum, moe_swiglu

E, INTER, HIDDEN, LIMIT = 16, 1024, 2048, 10.0
# (weight rows a program, K step, warps, stages)
GATE_UP_GRID = ((64, 64, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4), (64, 128, 4, 4),
                (32, 128, 4, 4), (64, 64, 4, 2), (32, 64, 4, 4))  # fmt: skip
DOWN_GRID = ((16, 256, 4, 4), (16, 128, 4, 4), (16, 512, 4, 4), (32, 256, 4, 4),
             (32, 128, 4, 4), (16, 256, 2, 4), (16, 128, 2, 4))  # fmt: skip


def weights(layers: int, gen: torch.Generator):
    rows = (E + 1) * 2 * INTER + E
    xw = [(torch.randn(rows, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16().cuda()
          for _ in range(layers)]  # fmt: skip
    down = [(torch.randn(E + 1, HIDDEN, INTER, generator=gen) / INTER**0.5).bfloat16().cuda()
            for _ in range(layers)]  # fmt: skip
    return xw, down


def time_rows(t: int, xw, down, gen: torch.Generator, args) -> dict:
    """One batch size's timings (module docstring)."""
    split = (E + 1) * 2 * INTER
    x = torch.randn(t, HIDDEN, generator=gen).bfloat16().cuda()
    dense = (torch.rand(t, E, generator=gen) * (torch.rand(t, E, generator=gen) < 0.2)).cuda()
    h_ref = [moe_swiglu(F.linear(x, w)[:, :split], E + 1, LIMIT) for w in xw]
    y_ref = [expert_weighted_sum(y[:-1], dense, add=y[-1])
             for y in (torch.bmm(h_ref[i], down[i].transpose(1, 2))
                       for i in range(args.layers))]  # fmt: skip

    def per_layer(calls) -> float:
        return graph_time(calls, args.reps) / args.layers * 1e6

    def cublas_gate_up(i):
        return lambda: moe_swiglu(F.linear(x, xw[i])[:, :split], E + 1, LIMIT)

    def cublas_down(i):
        def run():
            y = torch.bmm(h_ref[i], down[i].transpose(1, 2))
            return expert_weighted_sum(y[:-1], dense, add=y[-1])

        return run

    def cublas_both(i):
        def run():
            h = moe_swiglu(F.linear(x, xw[i])[:, :split], E + 1, LIMIT)
            y = torch.bmm(h, down[i].transpose(1, 2))
            return expert_weighted_sum(y[:-1], dense, add=y[-1])

        return run

    res = {"rows": t}
    res["cublas_gate_up_us"] = per_layer([cublas_gate_up(i) for i in range(args.layers)])
    res["cublas_down_us"] = per_layer([cublas_down(i) for i in range(args.layers)])
    res["cublas_both_us"] = per_layer([cublas_both(i) for i in range(args.layers)])
    res["gate_up"] = {}
    for p in GATE_UP_GRID:
        plan = md.MoeDecodePlan(*p)
        h, _ = md.moe_gate_up_swiglu(x, xw[0], E, INTER, LIMIT, plan)
        torch.testing.assert_close(h, h_ref[0], atol=2e-2, rtol=1.6e-2)
        res["gate_up"][str(p)] = per_layer(
            [
                lambda i=i, plan=plan: md.moe_gate_up_swiglu(x, xw[i], E, INTER, LIMIT, plan)
                for i in range(args.layers)
            ]  # fmt: skip
        )
    res["down"] = {}
    for p in DOWN_GRID:
        plan = md.MoeDecodePlan(*p)
        out = md.moe_down_sum(h_ref[0], down[0], dense, plan)
        torch.testing.assert_close(out, y_ref[0], atol=3e-2, rtol=2e-2)
        res["down"][str(p)] = per_layer(
            [
                lambda i=i, plan=plan: md.moe_down_sum(h_ref[i], down[i], dense, plan)
                for i in range(args.layers)
            ]  # fmt: skip
        )

    def kernels_both(i):
        def run():
            h, _ = md.moe_gate_up_swiglu(x, xw[i], E, INTER, LIMIT)
            return md.moe_down_sum(h, down[i], dense)

        return run

    res["kernels_both_us"] = per_layer([kernels_both(i) for i in range(args.layers)])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    xw, down = weights(args.layers, gen)
    gu_bytes = xw[0].numel() * 2
    dn_bytes = down[0].numel() * 2
    dev = torch.cuda.get_device_name()
    print(f"{dev}  gate/up weight {gu_bytes / 1e6:.1f} MB, down {dn_bytes / 1e6:.1f} MB, "
          f"{args.layers} copies", flush=True)  # fmt: skip
    rows_out = []
    for t in (int(v) for v in args.rows.split(",")):
        res = time_rows(t, xw, down, gen, args)
        rows_out.append(res)
        bw = lambda nbytes, us: nbytes / us / 1e3  # noqa: E731  GB/s
        print(f"\nT={t}: cuBLAS gate/up {res['cublas_gate_up_us']:.1f} us "
              f"({bw(gu_bytes, res['cublas_gate_up_us']):.0f} GB/s), down "
              f"{res['cublas_down_us']:.1f} us ({bw(dn_bytes, res['cublas_down_us']):.0f} GB/s), "
              f"both {res['cublas_both_us']:.1f} us; kernels both {res['kernels_both_us']:.1f} us "
              f"({res['cublas_both_us'] / res['kernels_both_us']:.3f}x)")  # fmt: skip
        for name, grid, nbytes in (("gate_up", GATE_UP_GRID, gu_bytes), ("down", DOWN_GRID,
                                                                          dn_bytes)):  # fmt: skip
            for p in grid:
                us = res[name][str(p)]
                print(f"  {name} plan {p}: {us:.1f} us ({bw(nbytes, us):.0f} GB/s)")
        sys.stdout.flush()
    if args.out:
        out = {
            "bench": "moe_decode",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": dev,
            "command": "python3 " + " ".join(sys.argv),
            "layers": args.layers,
            "rows": rows_out,
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
