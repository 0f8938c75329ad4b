"""Host time of one graph-replayed hybrid decode step: ``HybridDecodeGraphs.stage`` on CPU.

Builds the family `bench/bench_hybrid.py::run_decode` builds (its model config's layer specs,
block tables of ``context + steps`` tokens from a random block permutation (int32 numpy rows, as
the engine passes them), one state slot per
sequence, a `TokenIds` view of the tokens), with one layer of each kind instead of all twelve:
the staged facts depend on the set of ``(ratio, overlap)`` series, not on the layer count, and
the caches (which staging never reads) then fit in host memory at 128K. The graph runner is
built without a model (staging needs none) and its bucket marked captured, so ``stage`` runs
the engine's host half exactly: the family's continuation checks, ``StaticDecodeStep.stage``
(``stage_decode_on_device`` with CPU buffers, ``plan_compressor_state`` per series), the
bookkeeping.

Per (kv_format, context): the median of ``--reps`` steps (each one position further, as decode
steps are; thread CPU time, so that other processes on a shared host do not count) and, with ``--cprofile``, the top functions by own time. ``--before DIR`` also runs
this script with ``PYTHONPATH=DIR`` (another checkout of kvplan, e.g. the commit before a
change) and prints both columns from the same invocation.

    PYTHONPATH=. python3 bench/profile_hybrid_stage.py --cprofile
    PYTHONPATH=. python3 bench/profile_hybrid_stage.py --before /tmp/kvplan_before
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_hybrid import model_config  # noqa: E402

from kvplan.backends.hybrid.api import HybridSeq  # noqa: E402
from kvplan.backends.hybrid.planned import PlannedHybridFamily  # noqa: E402
from kvplan.engine.hybrid_graphs import HybridDecodeGraphs  # noqa: E402
from kvplan.engine.request import TokenIds  # noqa: E402


def one_of_each_kind(specs: list) -> list:
    """The first layer spec of each kind, in layer order."""
    seen, out = set(), []
    for spec in specs:
        if spec.kind not in seen:
            seen.add(spec.kind)
            out.append(spec)
    return out


def build(kv_format: str, batch: int, context: int, reps: int, block_size: int):
    """(runner, make_seqs): a runner whose ``stage(make_seqs(i))`` is step ``i``."""
    specs = one_of_each_kind(model_config(False).layer_specs())
    max_len = context + reps + 2
    blocks_per_seq = -(-max_len // block_size)
    family = PlannedHybridFamily(
        specs, block_size=block_size, num_blocks=batch * blocks_per_seq + 1,
        num_state_slots=batch, max_model_len=max_len, kv_format=kv_format,
        dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    perm = torch.randperm(batch * blocks_per_seq, generator=torch.Generator().manual_seed(0)) + 1
    # int32 numpy rows, as the engine hands the family (KVCacheManager.get_block_ids_view)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).numpy()
    token_ids = TokenIds([0] * max_len, [])
    family.record([HybridSeq(b, 0, context, token_ids, tables[b], b) for b in range(batch)])
    runner = HybridDecodeGraphs(None, family, batch)
    runner.graphs[batch] = None  # staging only: the bucket counts as captured

    def make_seqs(i: int) -> list[HybridSeq]:
        return [HybridSeq(b, context + i, 1, token_ids, tables[b], b) for b in range(batch)]

    return runner, make_seqs


def measure(args) -> list[dict]:
    rows = []
    for kv_format in args.formats.split(","):
        for context in map(int, args.contexts.split(",")):
            runner, make_seqs = build(kv_format, args.batch, context, 2 * args.reps + 10,
                                      args.block_size)  # fmt: skip
            for i in range(10):  # warm-up
                runner.stage(make_seqs(i))
            times = []
            gc.collect()
            for i in range(10, 10 + args.reps):
                seqs = make_seqs(i)
                t0 = time.thread_time()
                runner.stage(seqs)
                times.append(time.thread_time() - t0)
            row = {"kv_format": kv_format, "context": context, "batch": args.batch,
                   "stage_ms": statistics.median(times) * 1e3,
                   "p10_ms": sorted(times)[len(times) // 10] * 1e3}  # fmt: skip
            if args.cprofile:
                prof = cProfile.Profile()
                base = 10 + args.reps
                all_seqs = [make_seqs(base + i) for i in range(args.reps)]
                prof.enable()
                for seqs in all_seqs:
                    runner.stage(seqs)
                prof.disable()
                st = pstats.Stats(prof)
                top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
                row["cprofile"] = [
                    {"us_per_step": v[2] / args.reps * 1e6, "calls": v[1] / args.reps,
                     "fn": f"{os.path.basename(k[0])}:{k[1]}:{k[2]}"}
                    for k, v in top
                ]  # fmt: skip
            rows.append(row)
            del runner, make_seqs
            gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--formats", default="fp8,exact")
    ap.add_argument("--block-size", type=int, default=256, help="bench_hybrid's CUDA default")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--before", default=None, help="a kvplan checkout to time as 'before'")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    before = None
    if args.before:
        cmd = [sys.executable, __file__, "--json", f"--batch={args.batch}",
               f"--contexts={args.contexts}", f"--formats={args.formats}",
               f"--block-size={args.block_size}", f"--reps={args.reps}"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.before))
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        before = {(r["kv_format"], r["context"]): r for r in json.loads(res.stdout)}
    rows = measure(args)
    if args.json:
        print(json.dumps(rows))
        return
    head = f"{'format':>6} {'context':>8} {'batch':>5} {'stage ms':>9} {'p10 ms':>7}"
    print(head + (f" {'before ms':>10} {'speedup':>8}" if before else ""))
    for r in rows:
        line = (f"{r['kv_format']:>6} {r['context']:>8} {r['batch']:>5} {r['stage_ms']:9.3f} "
                f"{r['p10_ms']:7.3f}")  # fmt: skip
        if before:
            b = before[(r["kv_format"], r["context"])]["stage_ms"]
            line += f" {b:10.3f} {b / r['stage_ms']:7.1f}x"
        print(line)
    for r in rows:
        if "cprofile" in r:
            print(f"\ncProfile {r['kv_format']} {r['context']} (own time per step):")
            for p in r["cprofile"]:
                print(f"  {p['us_per_step']:8.1f} us  x{p['calls']:5.1f}  {p['fn']}")


if __name__ == "__main__":
    main()
