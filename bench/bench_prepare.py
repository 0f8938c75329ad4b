"""prepare() CPU time per step, per backend, against a per-request Python-list baseline.

Two batches: 256 decode sequences, and a 32-sequence mixed batch (16 prefill chunks, some over
cached history, + 16 decode rows). For each backend, ``step us`` times one step's metadata
update from Python lists: the per-step setters plus ``prepare()`` (host math, staging, async
H2D launches; no device sync inside); ``prepare us`` times ``prepare()`` alone. The speedup is
baseline / step (both start from the same lists). The three are sampled in interleaved rounds
(20 steps, 20 prepares, 5 baseline steps per round), so a drifting host load hits both sides
of the ratio alike. The baseline builds the same backend's
fields the pre-vectorized way: one Python list per request (``get_block_ids``), per-token
loops, then one ``torch.tensor`` + copy to the device per field (see ``baseline``). Medians
over ``--iters`` steps; the device is synchronized between steps, outside the timed region.
On a GPU each backend runs three times: the defaults there (``expand_on_device``: per-token
slots and the ragged page list expanded by one kernel from per-row facts; ``staging`` ring:
the arena's copy from a ``PinnedRing`` buffer through the CUDA runtime), then with host
expansion (all fields on the host), then with torch's staging (a fresh
``torch.empty(pin_memory=True)`` snapshot + ``copy_``); ``gpu copy us`` / ``gpu expand us`` are the device time per step of the staged
copy and of the expansion kernel (torch profiler). ``calls`` is the number of Python-level
function calls (numpy/torch C functions and methods
included, operators and slicing not) of one ``prepare()``, counted with cProfile outside the
timed runs: on a slow host CPU each call's fixed cost dominates, so it predicts ``prepare us``
there (``bench/host_primitives.py`` measures the per-call costs).

    PYTHONPATH=. python3 bench/bench_prepare.py --out bench/results/bench_prepare.json
    PYTHONPATH=. python3 bench/bench_prepare.py --quick      # tiny, CPU-friendly
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from kvplan.backends import BACKEND_NAMES, get_backend
from kvplan.cache.kv_cache_manager import KVCacheManager


def make_batch(kind: str, num_seqs: int, max_ctx: int, block_size: int, seed: int = 0):
    """A manager holding the batch's requests and the per-step fields of one step."""
    rng = np.random.default_rng(seed)
    max_blocks = -(-(max_ctx + 1024) // block_size)
    mgr = KVCacheManager(
        num_seqs * max_blocks + 8, block_size, max_blocks_per_seq=max_blocks,
        enable_prefix_caching=False,
    )  # fmt: skip
    num_ctx = 0 if kind == "decode" else num_seqs // 2
    seq_lens, cached = [], []
    for rid in range(num_seqs):
        if rid < num_ctx:
            hist = int(rng.integers(0, max_ctx // 2)) if rid % 2 else 0
            chunk = int(rng.integers(128, 513))
            mgr.add_request(rid, list(range(hist + chunk)))
            seq_lens.append(chunk)
            cached.append(hist)
        else:
            hist = int(rng.integers(max_ctx // 4, max_ctx))
            mgr.add_request(rid, list(range(hist)))
            assert mgr.extend(rid, 1).ok
            seq_lens.append(1)
            cached.append(hist)
    return mgr, list(range(num_seqs)), num_ctx, seq_lens, cached


def step_ours(md, rids, num_ctx, seq_lens, cached) -> None:
    md.request_ids = rids
    md.num_contexts = num_ctx
    md.seq_lens = seq_lens
    md.num_cached_tokens_per_seq = cached
    md.prepare()


def baseline(name: str, mgr, rids, num_ctx, seq_lens, cached, device) -> dict:
    """The same fields built per request with Python lists (what ``prepare()`` replaces).

    Per backend it produces what that backend's ``prepare()`` produces for the kernels (one
    device tensor per field, from a Python list): shared by all, ``seq_lens``, ``cu_seqlens_q``
    (``qo_indptr``) and the new tokens' slots; vanilla: one padded block table
    ``[n, max logical blocks]``; ragged: indices / indptr / last_page_len / kv_lens /
    batch_indices / positions and the decode indptrs; block offsets: the ``[n, 2, width]``
    table, kv_lens, request types, the generation ``qo_indptr`` and the two KV totals.
    """
    bs = mgr.block_size
    n = len(rids)
    kv_lens = [c + s for c, s in zip(cached, seq_lens)]
    block_lists = [mgr.get_block_ids(r) for r in rids]
    slots, positions, batch_indices = [], [], []
    for b, (ids, c, s) in enumerate(zip(block_lists, cached, seq_lens)):
        for p in range(c, c + s):
            slots.append(ids[p // bs] * bs + p % bs)
            positions.append(p)
            batch_indices.append(b)
    qo = [0]
    for s in seq_lens:
        qo.append(qo[-1] + s)
    lists = {"seq_lens": list(seq_lens), "qo": qo}
    if name == "vanilla":
        width = max(-(-k // bs) for k in kv_lens)
        table = []
        for ids, k in zip(block_lists, kv_lens):
            row = ids[: -(-k // bs)]
            table.append(row + [0] * (width - len(row)))
        dev = {k: torch.tensor(v, dtype=torch.int32).to(device) for k, v in lists.items()}
        dev["slots"] = torch.tensor(slots, dtype=torch.int64).to(device)
        dev["table"] = torch.tensor(table, dtype=torch.int32).to(device)
        return dev
    if name == "ragged":
        indices, indptr, last = [], [0], []
        for ids, k in zip(block_lists, kv_lens):
            nb = -(-k // bs)
            indices.extend(ids[:nb])
            indptr.append(indptr[-1] + nb)
            last.append(k - (nb - 1) * bs)
        lists.update(indices=indices, indptr=indptr, last=last, kv_lens=kv_lens, slots=slots,
                     positions=positions, batch_indices=batch_indices,
                     indptr_decode=[x - indptr[num_ctx] for x in indptr[num_ctx:]],
                     qo_decode=[x - qo[num_ctx] for x in qo[num_ctx:]])  # fmt: skip
        return {k: torch.tensor(v, dtype=torch.int32).to(device) for k, v in lists.items()}
    width = max(-(-k // bs) for k in kv_lens)
    table = []
    for ids in block_lists:
        row = ids[:width] + [0] * (width - len(ids[:width]))
        table.append([row, row])
    types = [0 if b < num_ctx else 1 for b in range(n)]
    totals = [sum(kv_lens[:num_ctx]), sum(kv_lens[num_ctx:])]
    lists.update(kv_lens=kv_lens, slots=slots, types=types,
                 qo_gen=[x - qo[num_ctx] for x in qo[num_ctx:]])  # fmt: skip
    dev = {k: torch.tensor(v, dtype=torch.int32).to(device) for k, v in lists.items()}
    dev["totals"] = torch.tensor(totals, dtype=torch.int64)  # host, like host_total_kv_lens
    dev["table"] = torch.tensor(table, dtype=torch.int32).to(device)
    return dev


def sample_us(fn, device) -> float:
    """Microseconds of one ``fn()`` (the device synchronized first, outside the timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def timed_interleaved(fns: dict, iters: int, device, block: dict) -> dict:
    """Median microseconds of each ``fns[name]()``, sampled in interleaved rounds of blocks:
    a round runs ``block[name]`` calls of each function in turn, until each has ``iters``
    samples in all (``iters * block / block_ours`` for the slower ones). All of them see the
    same host state over the run (a busy shared host drifts within seconds, and blocks of one
    function then the other would turn that drift into the ratio), while calls inside a
    block run warm, as in a step loop. (Alternating single calls would measure each right
    after the others evicted its caches.)"""
    samples: dict = {name: [] for name in fns}
    rounds = max(1, iters // max(block.values()))
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(block[name]):
                samples[name].append(sample_us(fn, device))
    return {name: statistics.median(v) for name, v in samples.items()}


def count_calls(fn, reps: int = 10) -> float:
    """Function calls per ``fn()`` (cProfile ``total_calls``, the profiler's own stop excluded)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    return (pstats.Stats(prof).total_calls - 1) / reps


def gpu_us(fn, reps: int = 20) -> dict:
    """Device time per ``fn()`` (torch profiler, kernel and memcpy durations averaged over
    ``reps`` calls): ``copy`` = the staged host-to-device copies, ``expand`` = the device
    expansion kernel (0 when the step launches none)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {"copy": 0.0, "expand": 0.0}
    for evt in prof.key_averages():
        t = evt.device_time_total / reps
        if "expand_step_kernel" in evt.key:
            out["expand"] += t
        elif "Memcpy HtoD" in evt.key:
            out["copy"] += t
    return out


def run_case(kind, num_seqs, max_ctx, block_size, iters, device) -> list[dict]:
    mgr, rids, num_ctx, seq_lens, cached = make_batch(kind, num_seqs, max_ctx, block_size)
    rows = []
    # a GPU runs the defaults (device expansion, ring staging) and, side by side, host
    # expansion and torch's staging (one change each)
    paths = (
        [(True, True), (False, True), (True, False)] if device.type == "cuda" else [(False, False)]
    )
    for name, (on_device, ring) in ((name, p) for name in BACKEND_NAMES for p in paths):
        cls = get_backend(name)
        md = cls.Metadata(
            max_num_requests=num_seqs, max_num_tokens=max(sum(seq_lens), 1),
            kv_cache_manager=mgr, device=device,
        )  # fmt: skip
        md.expand_on_device = on_device
        if not ring:
            md.arena.ring = None  # torch.empty(pin_memory=True) + copy_ per step
        for _ in range(3):  # warm up (allocator, first copies, kernel compile)
            step_ours(md, rids, num_ctx, seq_lens, cached)
            baseline(name, mgr, rids, num_ctx, seq_lens, cached, device)
        med = timed_interleaved(
            {"ours": lambda md=md: step_ours(md, rids, num_ctx, seq_lens, cached),
             "prepare": md.prepare,
             "base": lambda name=name: baseline(name, mgr, rids, num_ctx, seq_lens, cached,
                                                device)},
            iters, device, block={"ours": 20, "prepare": 20, "base": 5},
        )  # fmt: skip
        ours, prep, base = med["ours"], med["prepare"], med["base"]
        calls = count_calls(md.prepare)
        gpu = gpu_us(md.prepare) if device.type == "cuda" else {}
        rows.append(dict(batch=kind, prepare_calls=calls, num_seqs=num_seqs, num_tokens=sum(seq_lens),
                         num_blocks=int(sum(-(-(c + s) // block_size) for c, s in zip(cached, seq_lens))),
                         backend=name, expand="device" if on_device else "host",
                         staging="ring" if md.arena.ring is not None else "torch", step_us=ours, prepare_us=prep, baseline_us=base,
                         speedup=base / ours, gpu_copy_us=gpu.get("copy"),
                         gpu_expand_us=gpu.get("expand")))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write a JSON record here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU debugging)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-ctx", type=int, default=None, help="longest cached history")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    iters = args.iters or (20 if args.quick else 200)
    max_ctx = args.max_ctx or (256 if args.quick else 2048)
    decode_seqs, mixed_seqs = (32, 8) if args.quick else (256, 32)
    rows = run_case("decode", decode_seqs, max_ctx, args.block_size, iters, device)
    rows += run_case("mixed", mixed_seqs, max_ctx, args.block_size, iters, device)
    print(f"{'batch':7} {'seqs':>5} {'tokens':>6} {'backend':14} {'expand':6} {'staging':7} {'step us':>8} "
          f"{'prepare us':>11} {'calls':>6} {'baseline us':>12} {'speedup':>8} "
          f"{'gpu copy us':>11} {'gpu expand us':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:7} {r['num_seqs']:5d} {r['num_tokens']:6d} {r['backend']:14} {r['expand']:6} {r['staging']:7} "
              f"{r['step_us']:8.1f} {r['prepare_us']:11.1f} {r['prepare_calls']:6.0f} {r['baseline_us']:12.1f} "
              f"{r['speedup']:7.1f}x {r['gpu_copy_us'] or 0:11.1f} {r['gpu_expand_us'] or 0:13.1f}")  # fmt: skip
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "command": " ".join(["python3", *sys.argv]),
        "block_size": args.block_size,
        "max_ctx": max_ctx,
        "iters": iters,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
