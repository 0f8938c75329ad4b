"""Where a DeepSeek-V4 decode step's torch-launched device work comes from: the benchmark
model of `bench_hybrid.py` (fp8 KV, batch and context as given) runs eager decode steps under
the torch profiler with Python stacks, and every aten op that itself launched device work
(copies, fills, memsets, elementwise ops, cuBLAS GEMMs) is listed per step, grouped by the
op and its innermost ``kvplan/`` source line, with its count and device time. Triton kernels
are summed as one line.

GPU:  PYTHONPATH=. python3 bench/hybrid_small_ops.py --out ops.json
CPU:  PYTHONPATH=. python3 bench/hybrid_small_ops.py --quick   (tiny model; CPU time)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid import bench_model, fill_caches, model_config, sync  # noqa: E402

from kvplan.backends.hybrid.api import HybridSeq  # noqa: E402
from kvplan.backends.hybrid.planned import PlannedHybridFamily  # noqa: E402
from kvplan.engine.request import TokenIds  # noqa: E402
from kvplan.ops.argmax import argmax_rows  # noqa: E402


def _site(event) -> str:
    """The innermost ``kvplan/`` frame above ``event``: its recorded stack, or else its
    parents in the event tree (this torch records Python frames as events)."""
    for frame in event.stack or []:
        if "kvplan/" in frame:
            return frame[frame.index("kvplan/") :]
    parent = event.cpu_parent
    while parent is not None:
        if "kvplan/" in parent.name:
            return parent.name[parent.name.index("kvplan/") :]
        parent = parent.cpu_parent
    return "?"


def small_ops(prof, cuda: bool, steps: int) -> list[dict]:
    """Ops that launched device work themselves, grouped by (name, source line)."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    groups: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        dev_us = sum(k.duration for k in e.kernels) if cuda else getattr(e, attr, 0.0)
        if cuda and not e.kernels:
            continue
        name = e.name
        if not name.startswith("aten::") and not cuda:
            continue
        key = (name if name.startswith("aten::") else "triton/other", _site(e))
        groups[key][0] += len(e.kernels) if cuda else 1
        groups[key][1] += dev_us
    rows = [
        {"op": k[0], "site": k[1], "launches": v[0] / steps, "us": v[1] / steps}
        for k, v in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = model_config(not cuda)
    batch = args.batch if cuda else 2
    context = args.context if cuda else 64
    block_size = 256 if cuda else 32
    model = bench_model(cfg, dev, dtype)
    max_len = context + 4 + 2 * args.steps
    per_seq = -(-max_len // block_size)
    family = PlannedHybridFamily(
        cfg.layer_specs(), block_size=block_size, num_blocks=batch * per_seq + 1,
        num_state_slots=batch, max_model_len=max_len, kv_format=args.kv_format, dtype=dtype,
        device=dev,
    )  # fmt: skip
    tables = (torch.arange(batch * per_seq, dtype=torch.int32) + 1).view(batch, per_seq).numpy()
    token_ids = TokenIds([0] * max_len, [])
    seqs = [HybridSeq(b, context, 1, token_ids, tables[b], b) for b in range(batch)]
    gen = torch.Generator(device=dev).manual_seed(1)
    fill_caches(family, seqs, context, gen)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=dev)

    def step(q: int) -> None:
        nonlocal ids
        seqs = [HybridSeq(b, q, 1, token_ids, tables[b], b) for b in range(batch)]
        positions = torch.full((batch,), q, dtype=torch.int64, device=dev)
        ctx = family.plan(seqs, positions)
        with torch.no_grad():
            ids = argmax_rows(model(ids, positions, ctx))

    for i in range(3):
        step(context + i)
    sync(dev)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True) as prof:
        for i in range(args.steps):
            step(context + 3 + i)
        sync(dev)
    rows = small_ops(prof, cuda, args.steps)
    total = sum(r["launches"] for r in rows)
    print(f"{'op':32} {'launches':>8} {'us':>8}  site   ({total:.0f} launches a step)")
    for r in rows:
        print(f"{r['op'][:32]:32} {r['launches']:8.1f} {r['us']:8.1f}  {r['site']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"batch": batch, "context": context, "kv_format": args.kv_format,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
