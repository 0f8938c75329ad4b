"""cProfile of one backend's per-step metadata update (setters + ``prepare()``).

Uses ``bench_prepare``'s batches; prints the top functions by own time, per step.

    PYTHONPATH=. python3 bench/profile_prepare.py decode block_offsets [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_prepare import make_batch, step_ours  # noqa: E402

from kvplan.backends import get_backend  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", choices=("decode", "mixed"))
    ap.add_argument("backend")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = 256 if args.batch == "decode" else 32
    mgr, rids, num_ctx, seq_lens, cached = make_batch(args.batch, n, 2048, 32)
    md = get_backend(args.backend).Metadata(
        max_num_requests=n, max_num_tokens=max(sum(seq_lens), 1), kv_cache_manager=mgr,
        device=dev,
    )  # fmt: skip
    for _ in range(5):
        step_ours(md, rids, num_ctx, seq_lens, cached)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step_ours(md, rids, num_ctx, seq_lens, cached)
    prof.disable()
    print(f"== {args.batch} {args.backend} on {dev}: totals over {args.steps} steps")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
