"""Where one step's host time goes: the step with one part knocked out at a time.

For each of ``bench_prepare``'s six (batch, backend) cases (defaults: device expansion, ring
staging), the median host time of one step (setters + ``prepare()``, device synchronized
before each, outside the timing) in these variants, sampled in interleaved 20-step blocks so
a drifting host load hits them alike:

* ``full``: the defaults;
* ``torch_staging``: the arena's copy through ``torch.empty(pin_memory=True)`` + ``copy_``;
* ``no_copy``: the step's copy not sent (its staging buffer still filled);
* ``no_launch``: the expansion kernel not launched;
* ``no_copy_no_launch``: neither (what is left is Python and numpy);
* ``setters_only``: the four setters; ``prepare_common``: the shared host math.

Knocked-out variants compute wrong device fields: they are timing probes, nothing reads their
output. Then, in isolation after a synchronize (always run): one ring copy, one expansion
launch, both back to back, and torch's snapshot copy.

    PYTHONPATH=. python3 bench/step_parts.py [--rounds 15] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_prepare import baseline, make_batch, sample_us, step_ours  # noqa: E402

import kvplan.backends.staging.arena as staging  # noqa: E402
import kvplan.backends.staging.expand as device_expand  # noqa: E402
from kvplan.backends import BACKEND_NAMES, get_backend  # noqa: E402

COMMIT = staging.DeviceArena.commit
LAUNCH = device_expand.DeviceExpander.launch


def commit_nothing(arena) -> None:
    if arena._pending is not None and arena._pending[0] is None:
        arena.ring._slot = -1  # the acquired ring buffer goes unsent
    arena._pending = None


def launch_nothing(expander, n, args) -> None:
    return None


VARIANTS = {
    "full": {},
    "torch_staging": {"torch": True},
    "no_copy": {"commit": commit_nothing},
    "no_launch": {"launch": launch_nothing},
    "no_copy_no_launch": {"commit": commit_nothing, "launch": launch_nothing},
}


def case(batch: str, name: str, rounds: int, device) -> dict:
    n = 256 if batch == "decode" else 32
    mgr, rids, nc, sl, ca = make_batch(batch, n, 2048, 32)
    md = get_backend(name).Metadata(
        max_num_requests=n, max_num_tokens=max(sum(sl), 1), kv_cache_manager=mgr, device=device
    )
    ring = md.arena.ring

    def step():
        step_ours(md, rids, nc, sl, ca)

    def setters_only():
        md.request_ids, md.num_contexts, md.seq_lens = rids, nc, sl
        md.num_cached_tokens_per_seq = ca

    samples: dict[str, list[float]] = {k: [] for k in [*VARIANTS, "setters_only",
                                                       "prepare_common", "baseline"]}  # fmt: skip
    for _ in range(3):
        step()
    try:
        for _ in range(rounds):
            for key, v in VARIANTS.items():
                staging.DeviceArena.commit = v.get("commit", COMMIT)
                device_expand.DeviceExpander.launch = v.get("launch", LAUNCH)
                md.arena.ring = None if v.get("torch") else ring
                samples[key] += [sample_us(step, device) for _ in range(20)]
            staging.DeviceArena.commit, device_expand.DeviceExpander.launch = COMMIT, LAUNCH
            md.arena.ring = ring
            samples["setters_only"] += [sample_us(setters_only, device) for _ in range(20)]
            step()
            samples["prepare_common"] += [sample_us(md._prepare_common, device) for _ in range(20)]
            samples["baseline"] += [
                sample_us(lambda: baseline(name, mgr, rids, nc, sl, ca, device), device)
                for _ in range(4)
            ]
    finally:
        staging.DeviceArena.commit, device_expand.DeviceExpander.launch = COMMIT, LAUNCH
        md.arena.ring = ring
    return {k: round(statistics.median(v), 1) for k, v in samples.items()}


def micro(device) -> dict:
    """Isolated costs after a synchronize (median us over 2,000 calls)."""
    from kvplan.backends.staging import DeviceArena

    arena = DeviceArena({"a": 4096, "b": 4096}, device)
    expander = device_expand.DeviceExpander(arena.buffer, num_pools=1, slots64=False,
                                            token_rows=False)  # fmt: skip
    args = expander.bind(tokens=True, pages=False, cu_off=0, cached_off=64, table_off=128,
                         table_pool_stride=0, row_stride=32, slots_off=4096, block_size=32)  # fmt: skip
    arena.buffer.zero_()
    values = {"a": np.zeros(4096, np.int32)}

    def ring_copy():
        arena.stage(values)

    def launch():
        expander.launch(32, args)

    def both():
        arena.stage(values)
        expander.launch(32, args)

    def torch_copy():
        ring, arena.ring = arena.ring, None
        arena.stage(values)
        arena.ring = ring

    out = {}
    for key, fn in {"ring copy 16 KB": ring_copy, "expansion launch": launch,
                    "ring copy + launch": both, "torch copy 16 KB": torch_copy}.items():  # fmt: skip
        for _ in range(20):
            fn()
        out[key] = round(statistics.median(sample_us(fn, device) for _ in range(2000)), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_parts: needs a CUDA device (its variants knock out device work)")
        return 0
    device = torch.device("cuda")
    rows = {}
    for batch in ("decode", "mixed"):
        for name in BACKEND_NAMES:
            rows[f"{batch}/{name}"] = med = case(batch, name, args.rounds, device)
            print(f"{batch:6} {name:13}", " ".join(f"{k}={v}" for k, v in med.items()), flush=True)
    mic = micro(device)
    print(json.dumps(mic, indent=1))
    if args.out:
        record = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device),
            "command": " ".join(["python3", *sys.argv]),
            "rows": rows,
            "micro": mic,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
