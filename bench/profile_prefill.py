"""Where a long prompt's prefill spends its time, per KV format and fresh-row path.

Builds the engine benchmark's random-weight Llama (``llama-1b``, bf16) once per variant and
runs ``--prompts`` prompts of ``--prompt-len`` tokens, one prompt a step (the chunk budget is
the prompt length), each producing one token: the prefill alone. Variants, side by side in
one process:

* ``bf16``: a bf16 cache (fresh rows on SDPA / flash over the new K/V);
* ``<fmt>``: a quantized cache with the default fresh-row rule (SDPA / flash over the stored
  values from ``STORED_ROWS_MIN_LEN`` tokens);
* ``<fmt>-paged``: the same cache with the paged prefill kernel on every row (the rule off);
* ``<fmt>-w<N>``: the quantized cache with ``kv_exact_window=N`` (a prompt longer than N runs
  the paged kernel, each query's last N keys from the per-step ring);
* a ``+prefetch`` suffix: the quantized paged kernels load each key tile's bytes a tile ahead
  (``QUANT_PREFETCH``).

For each: milliseconds per prompt (median of ``--prompts``, CUDA-synchronized), and the
kernels of one prompt under torch.profiler (time per kernel name, top ``--top``). With
``--workload N,NEW``: instead, N prompts generating NEW tokens each, as ``bench_engine.py`` runs
them (the whole workload, decode steps and steps that mix prompts with decode rows), wall time
and the kernels of a second run under the profiler.

    PYTHONPATH=. python3 bench/profile_prefill.py --out prefill.json
    PYTHONPATH=. python3 bench/profile_prefill.py --quick --out q.json    (CPU, tiny, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from kvplan.backends import fresh_prefill
from kvplan.engine.cli_bench import make_prompts
from kvplan.engine.sampling import SamplingParams
from kvplan.models.config import named_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_engine import kernel_totals  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_profile(llm, prompts, params, dev, top: int) -> dict:
    """Where a run's wall time goes besides the kernels: torch.profiler with host and device
    activities over ``llm.generate(prompts)`` (the second of two profiled runs). Returns the wall time, the span from the first
    kernel's start to the last one's end, the device idle time inside that span (gaps between
    kernels), the time before the first kernel, and the host ops with the most self time
    (e.g. ``cudaStreamSynchronize`` or ``aten::item`` when the host waits on the device)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # the first profile in a process measures the profiler's start-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            sync(dev)
            wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type.name == "CUDA")  # fmt: skip
    host = [e.time_range.start for e in events if e.device_type.name == "CPU"]
    gaps, end = 0.0, None
    for a, b in kernels:
        if end is not None and a > end:
            gaps += a - end
        end = b if end is None else max(end, b)
    ops: dict[str, float] = {}
    for e in events:
        if e.device_type.name == "CPU":
            ops[e.name] = ops.get(e.name, 0.0) + e.self_cpu_time_total
    first = (kernels[0][0] - min(host)) / 1e3 if kernels and host else None
    return {
        "wall_ms": wall_ms,
        "kernel_span_ms": (end - kernels[0][0]) / 1e3 if kernels else 0.0,
        "device_idle_in_span_ms": gaps / 1e3,
        "before_first_kernel_ms": first,
        "host_self_ms": [
            {"op": k, "ms": v / 1e3} for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]
        ],  # fmt: skip
    }


def run_variant(name: str, args, cfg, dev, dtype) -> dict:
    from kvplan import LLM
    from kvplan.ops import _paged_attention_kernels as pk

    base, _, extra = name.partition("+")
    fmt, _, mode = base.partition("-")
    saved = fresh_prefill.STORED_ROWS_MIN_LEN, pk.QUANT_PREFETCH
    window = 0
    if mode == "paged":
        fresh_prefill.STORED_ROWS_MIN_LEN = 1 << 62
    elif mode.startswith("w") and mode[1:].isdigit():
        window = int(mode[1:])
    elif mode:
        raise ValueError(f"variant {name!r}: the mode after '-' must be 'paged' or 'w<N>'")
    if extra == "prefetch":
        pk.QUANT_PREFETCH = True
    try:
        n, new = args.workload or (2, 1)
        llm = LLM(cfg, device=dev, dtype=dtype, kv_format=fmt, max_num_seqs=n,
                  max_num_batched_tokens=max(args.prompt_len, 8192 if args.workload else 0),
                  max_model_len=args.prompt_len + new + 32,
                  kv_cache_memory=args.kv_cache_memory, kv_exact_window=window)  # fmt: skip
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        warm = make_prompts(n, args.prompt_len, cfg.vocab_size, seed=1)
        llm.generate(warm, params)
        sync(dev)
        ms = []
        if args.workload:
            runs = [make_prompts(n, args.prompt_len, cfg.vocab_size, seed=2)]
        else:
            runs = [
                [p] for p in make_prompts(args.prompts, args.prompt_len, cfg.vocab_size, seed=2)
            ]
        for batch in runs:
            t0 = time.perf_counter()
            llm.generate(batch, params)
            sync(dev)
            ms.append((time.perf_counter() - t0) * 1e3)
        row = {"variant": name, "ms_per_prompt": statistics.median(ms), "ms_all": ms}
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(runs[0] if args.workload else warm[:1], params)
                sync(dev)
            top = kernel_totals(prof, width=100)
            row["kernel_ms_total"] = sum(us for _, (_, us) in top) / 1e3
            row["kernels"] = [{"name": k, "calls": c, "ms": us / 1e3}
                              for k, (c, us) in top[: args.top]]  # fmt: skip
            if args.host:
                row["host"] = host_profile(llm, runs[0] if args.workload else warm[:1], params,
                                           dev, args.top)  # fmt: skip
        del llm
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return row
    finally:
        fresh_prefill.STORED_ROWS_MIN_LEN, pk.QUANT_PREFETCH = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--variants", default="bf16,fp8,fp8-paged,fp4,fp4-paged")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument(
        "--host",
        action="store_true",
        help="also a host + device profile of one run: device idle time between kernels, "
        "time before the first kernel, host ops by self time (CUDA only)",
    )
    ap.add_argument(
        "--workload",
        default=None,
        metavar="N,NEW",
        help="time N prompts x NEW new tokens as one workload instead",
    )
    args = ap.parse_args()
    if args.workload:
        args.workload = tuple(int(x) for x in args.workload.split(","))
    dev = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.quick:
        cfg, dtype = named_config("tiny-llama", head_dim_override=64), torch.float32
        args.prompt_len = args.prompt_len or 96
        args.kv_cache_memory = args.kv_cache_memory or (32 << 20)
    else:
        cfg, dtype = named_config("llama-1b"), torch.bfloat16
        args.prompt_len = args.prompt_len or 8192
        args.kv_cache_memory = args.kv_cache_memory or ((8 if args.workload else 2) << 30)
    rows = []
    for name in args.variants.split(","):
        row = run_variant(name, args, cfg, dev, dtype)
        rows.append(row)
        what = "workload" if args.workload else f"{args.prompt_len}-token prompt"
        print(f"{name:10s} {row['ms_per_prompt']:9.2f} ms per {what}"
              + (f"  (kernels {row['kernel_ms_total']:.2f} ms)" if "kernel_ms_total" in row else ""))  # fmt: skip
        for k in row.get("kernels", [])[:8]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:5d}  {k['name'][:80]}")
        if "host" in row:
            h = row["host"]
            print(f"  host profile: wall {h['wall_ms']:.2f} ms, kernels span "
                  f"{h['kernel_span_ms']:.2f} ms with {h['device_idle_in_span_ms']:.2f} ms idle, "
                  f"{h['before_first_kernel_ms']} ms before the first kernel")  # fmt: skip
            for o in h["host_self_ms"]:
                print(f"    {o['ms']:8.2f} ms  {o['op'][:80]}")
    rec = {
        "bench": "profile_prefill", "device": torch.cuda.get_device_name() if dev.type == "cuda"
        else "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompt_len": args.prompt_len, "workload": args.workload, "config": "tiny-llama" if args.quick else "llama-1b",
        "stored_rows_min_len": fresh_prefill.STORED_ROWS_MIN_LEN, "runs": rows,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
