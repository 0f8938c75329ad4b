"""Prompt attention of DeepSeek-V4 layers: index tables (``sparse_attention``, one program per
row loading every key for that row) vs ranges (``sparse_attention_ranges``, blocks of rows
sharing each key tile), at the real shapes: 16 heads x 512, window 128, HCA ratio 128, CSA
ratio 4 with top-k 512, ``--seqs`` fresh prompts of ``--prompt`` tokens (2 x 4,096 = one
8,192-token prefill chunk of ``bench_hybrid_hf.py``'s workload), bf16 queries and rows.

Cases: ``window`` (sliding layer), ``hca`` (window + every closed entry), ``csa`` (window +
top-k: rows whose prefix is at most 512 entries take the ranges kernel, the rest the index
kernel over their top-k through a row list, as ``PlannedStep`` does). Each new result is
checked against the index-table result (max |diff| / max |ref|, fails above 2e-2). Times:
``triton.testing.do_bench`` medians (ms). ``--sweep`` times a grid of the ranges kernel's
tilings per case.

    PYTHONPATH=. python3 bench/bench_prompt_ranges.py --sweep --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import shlex
import sys

import torch

from kvplan.ops.sparse_attention import KeySource, sparse_attention
from kvplan.ops.sparse_ranges import (
    RangeSource,
    range_tiling,
    ranges_index,
    sparse_attention_ranges,
)

HEADS, DIM, WINDOW, TOP_K = 16, 512, 128, 512


def build(seqs: int, prompt: int, ratio: int, gen: torch.Generator, dev: str):
    """Window ranges and rows, prefix ranges and entries of ``ratio`` (0: none), the top-k
    index of every row (random picks among its prefix when it is longer than TOP_K)."""
    t = seqs * prompt
    rows = (torch.randn(t, DIM, generator=gen) * 0.5).to(dev, torch.bfloat16)
    pos = torch.arange(prompt).repeat(seqs)
    base = torch.arange(seqs).repeat_interleave(prompt) * prompt
    lo = torch.clamp(pos + 1 - WINDOW, min=0)
    win = torch.stack([torch.zeros_like(pos), torch.zeros_like(pos), base + lo, pos + 1 - lo], 1)
    out = {"window": RangeSource(rows, win.to(dev, torch.int32).contiguous())}
    if ratio:
        per = prompt // ratio
        entries = (torch.randn(seqs * per, DIM, generator=gen) * 0.5).to(dev, torch.bfloat16)
        ks = torch.arange(seqs).repeat_interleave(prompt) * per
        klen = (pos + 1) // ratio
        out["prefix"] = RangeSource(entries, torch.stack([ks, klen], 1).to(dev, torch.int32))
        scores = torch.rand(t, per, generator=gen)
        scores[torch.arange(per)[None, :] >= klen[:, None]] = -1.0
        top = scores.topk(min(TOP_K, per), dim=1)
        idx = torch.where(top.values >= 0, ks[:, None] + top.indices, -1)
        out["topk"] = idx.sort(dim=1, descending=True).values.to(dev, torch.int32).contiguous()
        out["klen"] = klen
    return out


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60)


def run_case(case, ratio, args, q, sinks, scale, tile_t, gen, dev):
    """One case's row of the JSON (module docstring)."""
    d = build(args.seqs, args.prompt, ratio, gen, dev)
    win = d["window"]
    win_idx = KeySource(win.cache, ranges_index(win.ranges))
    if case == "window":
        old_src, new_src, hard = [win_idx], [win], None
    elif case == "hca":
        pre = d["prefix"]
        old_src = [win_idx, KeySource(pre.cache, ranges_index(pre.ranges))]
        new_src, hard = [win, pre], None
    else:
        pre = d["prefix"]
        old_src = [win_idx, KeySource(pre.cache, d["topk"])]
        new_src = [win, pre]
        easy_n = int((d["klen"][: args.prompt] <= TOP_K).sum())
        hard = torch.cat([torch.arange(s * args.prompt + easy_n, (s + 1) * args.prompt)
                          for s in range(args.seqs)]).to(dev, torch.int32)  # fmt: skip

    cached = {}

    def blocks_for(tt, n_easy=None):
        if tt in cached:
            return cached[tt]
        starts, ends = [], []
        n = args.prompt if n_easy is None else n_easy
        for s in range(args.seqs):
            b = torch.arange(s * args.prompt, s * args.prompt + n, tt)
            starts.append(b)
            ends.append(torch.clamp(b + tt, max=s * args.prompt + n))
        cached[tt] = (torch.cat(starts).to(dev, torch.int32), torch.cat(ends).to(dev, torch.int32))
        return cached[tt]

    n_easy = None if hard is None else easy_n

    def old():
        return sparse_attention(q, old_src, sinks, scale, check=False)

    def new(tiling=None):
        tiling = {"tile_t": tile_t, **(tiling or {})}
        tt = tiling["tile_t"]
        out = torch.empty_like(q)
        sparse_attention_ranges(q, new_src, sinks, scale, out=out, check=False,
                                blocks=blocks_for(tt, n_easy), **tiling)  # fmt: skip
        if hard is not None:
            sparse_attention(q, old_src, sinks, scale, out=out, rows=hard, check=False)
        return out

    ref = old().float()
    got = new().float()
    err = float((got - ref).abs().max() / ref.abs().max())
    row = {"rel_err": err, "old_ms": bench(old), "new_ms": bench(new)}

    if hard is not None:
        row["hard_rows"] = int(hard.numel())
        row["hard_only_ms"] = bench(
            lambda: sparse_attention(
                q, old_src, sinks, scale, out=torch.empty_like(q), rows=hard, check=False
            )  # fmt: skip
        )
    row["speedup"] = row["old_ms"] / row["new_ms"]
    print(case, json.dumps(row), flush=True)
    if args.sweep and case != "window":
        sweep = []
        for tt, tn, nw, ns in itertools.product((2, 4, 8), (16, 32, 64), (4, 8), (2,)):
            tiling = {"tile_t": tt, "tile_n": tn, "num_warps": nw, "num_stages": ns}
            try:
                e = float((new(tiling).float() - ref).abs().max() / ref.abs().max())
                ms = bench(lambda tiling=tiling: new(tiling))
            except Exception as exc:  # noqa: BLE001 - out of resources: skip the tiling
                sweep.append({**tiling, "error": type(exc).__name__})
                continue
            sweep.append({**tiling, "ms": ms, "rel_err": e})
        ok = [s for s in sweep if "ms" in s]
        ok.sort(key=lambda s: s["ms"])
        row["sweep"] = sweep
        print(case, "best", json.dumps(ok[:5]), flush=True)
    if err > 2e-2:
        print(f"FAIL {case}: rel err {err}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    t = args.seqs * args.prompt
    q = (torch.randn(t, HEADS, DIM, generator=gen) * 0.3).to(dev, torch.bfloat16)
    sinks = torch.randn(HEADS, generator=gen).to(dev)
    scale = DIM**-0.5
    tile_t = range_tiling(torch.bfloat16)["tile_t"]
    res = {"bench": "prompt_ranges", "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join(["python3", *map(shlex.quote, sys.argv)]),
           "python": platform.python_version(), "torch": torch.__version__,
           "rows": t, "cases": {}}  # fmt: skip
    for case, ratio in (("window", 0), ("hca", 128), ("csa", 4)):
        res["cases"][case] = run_case(case, ratio, args, q, sinks, scale, tile_t, gen, dev)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
