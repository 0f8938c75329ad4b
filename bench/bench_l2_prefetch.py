"""Narrow decode GEMMs with their weights asked into L2 ahead (`kvplan.ops.l2_prefetch`).

A layer of a decode step is modelled as ``filler -> GEMM``: the filler stands for the attention
kernel before the o projection (a kernel that keeps the SMs busy for ``--filler-us`` and reads
little), the GEMM is ``x [M, K] @ W^T`` with a different ``W [N, K]`` each layer (``--layers``
copies, together larger than L2, as a step streams its weights). A CUDA graph runs the layers
in a row; the figure is the median replay over the layers, minus the filler alone, i.e. what
the GEMM adds to a layer. Variants, in one process:

- ``gemm``: GEMMs only, back to back (no filler);
- ``none``: filler then GEMM;
- ``inline``: the prefetch of W launched before the filler, same stream;
- ``stream``: the prefetch on a side stream beside the filler (a parallel graph branch);
- ``hot``: one W for every layer (already in L2: the bound).

Outputs are compared with the ``none`` run (bit for bit: the prefetch changes no value).

Usage::

    PYTHONPATH=. python3 bench/bench_l2_prefetch.py --out OUT/l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from kvplan.ops.l2_prefetch import L2Prefetch

# llama-1b at batch 64 (qkv, o), the DeepSeek-V4 bench's narrow GEMMs at 32 rows
DEFAULT_SHAPES = ("64,3072,2048,qkv", "64,2048,2048,o", "32,2048,2048,dsv4_2k",
                  "32,4096,2048,dsv4_4k", "32,12288,512,dsv4_12k")  # fmt: skip


def parse_shape(text: str) -> tuple[int, int, int, str]:
    parts = text.split(",")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--shapes: {text!r} is not M,N,K[,name]")
    m, n, k = (int(p) for p in parts[:3])
    return m, n, k, parts[3] if len(parts) == 4 else f"{m}x{n}x{k}"


def replay_ms(body, reps: int) -> float:
    """Median ms of one replay of a graph capturing ``body()``."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_shape(m, n, k, layers, filler_cycles, reps, gen, tiles):
    dev = "cuda"
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]

    def chain(filler, prefetch, hot=False):
        def body():
            for i in range(layers):
                w = ws[0] if hot else ws[i]
                if prefetch is not None:
                    prefetch.issue((w,))
                if filler:
                    torch.cuda._sleep(filler_cycles)
                if prefetch is not None:
                    prefetch.join()
                torch.matmul(x, w.t(), out=outs[i])

        return body

    filler_ms = replay_ms(lambda: [torch.cuda._sleep(filler_cycles) for _ in range(layers)], reps)
    res = {"filler_us": filler_ms * 1e3 / layers}
    res["gemm_us"] = replay_ms(chain(False, None), reps) * 1e3 / layers
    ref = None
    variants = [("none", chain(True, None)), ("hot", chain(True, None, hot=True))]
    for lanes, chunk in tiles:
        for side in (False, True):
            name = f"{'stream' if side else 'inline'}_{lanes}x{chunk}"
            pf = L2Prefetch(side_stream=side, lanes=lanes, chunk=chunk)
            variants.append((name, chain(True, pf)))
    for name, body in variants:
        ms = replay_ms(body, reps)
        res[f"{name}_us"] = ms * 1e3 / layers - res["filler_us"]
        if name == "none":
            ref = [o.clone() for o in outs]
        elif name != "hot":
            res[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(ref, outs))
    res["weight_mb"] = n * k * 2 / 2**20
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--filler-us", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--tiles",
        default="32x2048,32x8192,128x1024,128x65536",
        help="prefetch launches to time: LANESxCHUNK, comma separated",
    )
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    # the filler's cycles from a measured rate (torch.cuda._sleep spins on the SM clock)
    probe = 200_000
    rate = replay_ms(lambda: torch.cuda._sleep(probe), 10) / probe  # ms a cycle
    cycles = max(1, int(a.filler_us / 1e3 / rate))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    print(f"device {torch.cuda.get_device_name()}; filler {a.filler_us} us ({cycles} cycles)")
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    for text in a.shapes:
        m, n, k, name = parse_shape(text)
        r = run_shape(m, n, k, a.layers, cycles, a.reps, gen, tiles)
        rows[name] = {"m": m, "n": n, "k": k, **r}
        print(
            f"{name}: W {r['weight_mb']:.1f} MB; us a layer: gemm alone {r['gemm_us']:.2f}, "
            f"none {r['none_us']:.2f}, hot {r['hot_us']:.2f}"
        )
        for key, v in r.items():
            if key.startswith(("inline_", "stream_")) and key.endswith("_us"):
                eq = r[key[:-3] + "_equal"]
                print(f"  {key[:-3]:22s} {v:7.2f}  equal {eq}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "filler_us": a.filler_us,
                       "layers": a.layers, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
