"""CPU time of the planning builders vs the per-token reference, in the same run.

* prompt: ``prepare_prompt`` for 64 sequences x 512-token chunks over history, three
  compression ratios + SWA (target <= 2 ms);
* decode: eager ``prepare_decode`` for 256 sequences x (1 + 2 draft tokens).

Each is timed (CPU time of the calling thread, median) against ``kvplan.plan.reference``
(per-token loops) on the same batch; minor page faults per call are reported too. With CUDA
available the builders are also timed with ``device="cuda"`` (host time including the pinned
copies, synchronized). Usage::

    PYTHONPATH=. python3 bench/bench_plan.py --out bench/results/plan.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import resource
import statistics
import sys
import time

import numpy as np
import torch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_decode, prepare_prompt
from kvplan.plan.reference import reference_decode, reference_prompt


def make_config(max_model_len: int) -> MetadataConfig:
    probe = dict(
        block_size=128, dense_ratios=(4, 128), sparse_ratios=(4, 16), window_size=128,
        swa_block_size=136, max_model_len=max_model_len, max_num_blocks=10**6,
    )  # fmt: skip
    need = MetadataConfig(**probe).num_blocks_for(max_model_len)
    return MetadataConfig(**{**probe, "max_num_blocks": need})


def make_batch(cfg, n, seqlen_q, drafts, rng):
    seqs, next_block = [], 1
    for i in range(n):
        seqlen_k = int(rng.integers(seqlen_q + 1, cfg.max_model_len // 2))
        need = cfg.num_blocks_for(seqlen_k)
        n_tok = seqlen_k if drafts == 0 else seqlen_k - drafts
        seqs.append(SequenceMetadata(
            seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            block_table=np.arange(next_block, next_block + need, dtype=np.int32), state_id=i,
            token_ids=rng.integers(0, 32000, n_tok, dtype=np.int32),
            draft_tokens=tuple(int(x) for x in rng.integers(0, 32000, drafts)),
        ))  # fmt: skip
        next_block += need
    return seqs


def median_time(fn, repeat: int, sync: bool = False) -> tuple[float, float, float]:
    """Median wall seconds, median CPU seconds of this thread, and minor page faults per call
    over ``repeat`` calls. CPU time (``time.thread_time``) is what the targets are about and
    is less disturbed by other processes on a shared host; wall time includes waiting (and,
    with ``sync``, the device copies)."""
    wall, cpu = [], []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        if sync:
            torch.cuda.synchronize()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / repeat
    return statistics.median(wall), statistics.median(cpu), faults


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU debugging)")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n_prompt, chunk, n_decode = (4, 32, 16) if args.quick else (64, 512, 256)
    repeat = 5 if args.quick else args.repeat
    cfg = make_config(4096 if args.quick else 65536)
    cases = {
        "prompt": (prepare_prompt, reference_prompt, make_batch(cfg, n_prompt, chunk, 0, rng)),
        "decode": (prepare_decode, reference_decode, make_batch(cfg, n_decode, 3, 2, rng)),
    }
    rows = []
    for name, (build, ref, seqs) in cases.items():
        build(seqs, cfg)  # warm up
        fast_wall, fast, faults = median_time(lambda b=build, s=seqs: b(s, cfg), repeat)
        slow_wall, slow, _ = median_time(lambda r=ref, s=seqs: r(s, cfg), 3 if args.quick else 2)
        row = {"case": name, "num_seqs": len(seqs), "total_q": sum(s.seqlen_q for s in seqs),
               "vectorized_cpu_ms": fast * 1e3, "vectorized_wall_ms": fast_wall * 1e3,
               "page_faults_per_call": faults,
               "reference_cpu_ms": slow * 1e3, "reference_wall_ms": slow_wall * 1e3,
               "speedup_cpu": slow / fast}  # fmt: skip
        if torch.cuda.is_available():
            gcfg = dataclasses.replace(cfg, device="cuda")
            build(seqs, gcfg)
            wall, cpu, _ = median_time(lambda b=build, s=seqs, c=gcfg: b(s, c), repeat, sync=True)
            row["to_cuda_cpu_ms"], row["to_cuda_wall_ms"] = cpu * 1e3, wall * 1e3
        rows.append(row)
    print(f"{'case':8} {'seqs':>5} {'rows':>6} {'cpu ms':>8} {'wall ms':>8} {'faults':>7} "
          f"{'ref cpu ms':>11} {'speedup':>8} {'to cuda cpu/wall ms':>20}")  # fmt: skip
    for r in rows:
        cuda = (f"{r['to_cuda_cpu_ms']:9.3f} /{r['to_cuda_wall_ms']:9.3f}"
                if "to_cuda_cpu_ms" in r else "")  # fmt: skip
        print(f"{r['case']:8} {r['num_seqs']:5d} {r['total_q']:6d} {r['vectorized_cpu_ms']:8.3f} "
              f"{r['vectorized_wall_ms']:8.3f} {r['page_faults_per_call']:7.1f} "
              f"{r['reference_cpu_ms']:11.1f} {r['speedup_cpu']:7.0f}x {cuda:>20}")  # fmt: skip
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "command": " ".join(["python3", *sys.argv]),
        "quick": args.quick,
        "config": dataclasses.asdict(cfg),
        "results": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
