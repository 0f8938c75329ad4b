"""Where a DeepSeek-V4 workload's steps go, one by one: kvplan's engine on
`bench/bench_hybrid.py`'s model (random bf16 weights, the `bench_hybrid_hf.py` workload),
every step of a warm run recorded with its kind, decode rows, prompt tokens and wall time,
and the non-decode steps (prefill / mixed: eager, no CUDA graph) profiled one at a time:
wall time, GPU kernel time, and the top host functions (cProfile) and kernels
(torch.profiler) of each.

Also: small eager steps alone, after the warm run (``--small``): a prompt of N tokens with
max_tokens=1 (one prefill step). ``--lean-ab ROUNDS``: the warm walk and an 8-token prompt
with kvplan's lean Triton launches (``kvplan.ops._launch``) off and on, alternating, in one
process.

GPU:  PYTHONPATH=. python3 bench/hybrid_steps.py --out steps.json
CPU:  PYTHONPATH=. python3 bench/hybrid_steps.py --quick --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import cprofile_rows  # noqa: E402
from bench_hybrid_hf import hf_config, sync  # noqa: E402


def build_folder(
    folder: str, quick: bool, max_len: int, dev: torch.device, layers: int | None = None
) -> int:
    """Save the random model (HF's `DeepseekV4ForCausalLM` of `bench_hybrid_hf.hf_config`,
    bf16; ``layers``: only that many layers) into ``folder``; its vocab."""
    import transformers as tf

    cfg = hf_config(quick, max_len, layers)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = tf.DeepseekV4ForCausalLM(cfg).eval().to(torch.bfloat16)
    hf.save_pretrained(folder)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return cfg.vocab_size


def step_rows(core) -> tuple[int, int]:
    """(decode rows, prompt tokens) the next `schedule` would give, read off the scheduler
    without scheduling (an estimate for the record: running decode rows and waiting /
    prefilling prompt tokens within the budget)."""
    sched = core.scheduler
    budget = sched.max_num_batched_tokens
    decode = sum(1 for r in sched.running if not r.is_prefilling)
    budget -= decode
    prompt = 0
    for r in sched.running:
        if r.is_prefilling:
            n = min(r.num_prefill_tokens - r.num_computed_tokens, budget)
            prompt, budget = prompt + n, budget - n
    for r in sched.waiting:
        if budget <= 0 or len(sched.running) >= sched.max_num_seqs:
            break
        n = min(len(r.all_token_ids), budget)
        prompt, budget = prompt + n, budget - n
    return decode, prompt


def profiled_step(core, dev: torch.device, top: int = 12) -> dict:
    """One engine step under torch.profiler then (same kind of step, next call) nothing:
    its wall ms, kernel ms and top kernels / host ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        core.step()
        sync(dev)
    wall = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"] if dev.type == "cuda" else []
    return {
        "wall_ms_profiled": wall,
        "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "kernel_launches": sum(e.count for e in kernels),
        "top_kernels": [
            {"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count}
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
        ],
        "top_host_ops": [
            {"name": e.key[:90], "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
        ],
    }


def walk(llm, ids, new: int, dev: torch.device, profile: str, top: int = 40) -> list[dict]:
    """Run the workload step by step; record each step. ``profile``: "" (none), "cprofile"
    or "torch": profile every non-decode step that way (cProfile: the ``top`` functions by
    own and by cumulative time)."""
    core = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for p in ids:
        core.add_request(p, params)
    steps = []
    while core.has_unfinished():
        decode, prompt = step_rows(core)
        row = {"decode_rows": decode, "prompt_tokens": prompt}
        if prompt and profile == "torch":
            row.update(profiled_step(core, dev))
        elif prompt and profile == "cprofile":
            sync(dev)
            t0 = time.perf_counter()
            rows = cprofile_rows(lambda: (core.step(), sync(dev)))
            row["wall_ms_profiled"] = (time.perf_counter() - t0) * 1e3
            row["host_own"] = rows[:top]
            row["host_cum"] = sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top]
        else:
            t0 = time.perf_counter()
            core.step()
            row["ms"] = (time.perf_counter() - t0) * 1e3
        row["kind"] = core.last_step_kind
        steps.append(row)
    sync(dev)
    return steps


def time_prompt(llm, prompt: list[int], dev: torch.device, runs: int = 5) -> list[float]:
    """Wall ms of ``runs`` generations of one token from ``prompt`` alone (one eager step).
    Each run computes the whole prompt: the prefix cache is reset before it (a dense
    engine's would otherwise serve every run after the first)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    walls = []
    for _ in range(runs):
        llm.parts.manager.reset_prefix_cache()
        sync(dev)
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        sync(dev)
        walls.append((time.perf_counter() - t0) * 1e3)
    return walls


def lean_ab(llm, ids, new: int, dev: torch.device, rounds: int) -> dict:
    """The warm walk and an 8-token prompt alone, ``rounds`` times each with the lean
    launches off and on (alternating); per setting the runs' wall s, eager step ms, decode
    median ms and the prompt's min ms."""
    from kvplan.ops import _launch

    out: dict = {"off": [], "on": []}
    try:
        for _ in range(rounds):
            for name, flag in (("off", False), ("on", True)):
                _launch.LEAN = flag
                sync(dev)
                t0 = time.perf_counter()
                steps = walk(llm, ids, new, dev, "")
                wall = time.perf_counter() - t0
                dec = sorted(s["ms"] for s in steps if s["kind"] == "decode")
                out[name].append({
                    "wall_s": wall,
                    "eager_ms": [s["ms"] for s in steps if s["prompt_tokens"]],
                    "decode_median_ms": dec[len(dec) // 2] if dec else None,
                    "prompt8_ms_min": min(time_prompt(llm, ids[0][:8], dev)),
                })  # fmt: skip
    finally:
        _launch.LEAN = True
    for name, runs in out.items():
        eager = [min(r["eager_ms"][i] for r in runs) for i in range(len(runs[0]["eager_ms"]))]
        print(f"lean launches {name:>3}: wall min {min(r['wall_s'] for r in runs):.3f} s, "
              f"eager steps (min) {', '.join(f'{e:.1f}' for e in eager)} ms, decode median "
              f"{min(r['decode_median_ms'] or 0 for r in runs):.3f} ms, 8-token prompt "
              f"{min(r['prompt8_ms_min'] for r in runs):.2f} ms")  # fmt: skip
    return out


def summarize(steps: list[dict]) -> None:
    for i, s in enumerate(steps):
        if s["prompt_tokens"] or i < 2:
            ms = s.get("ms", s.get("wall_ms_profiled"))
            extra = (f" kernels {s['kernel_ms']:.1f} ms / {s['kernel_launches']} launches"
                     if "kernel_ms" in s else "")  # fmt: skip
            print(f"step {i:3d} {s['kind'] or '-':>7}: {s['decode_rows']:3d} decode rows "
                  f"{s['prompt_tokens']:6d} prompt tokens {ms:8.2f} ms{extra}")  # fmt: skip
    dec = sorted(s["ms"] for s in steps if s["kind"] == "decode" and "ms" in s)
    if dec:
        print(f"decode steps: {len(dec)}, median {dec[len(dec) // 2]:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument("--profile", default="torch,cprofile",
                    help="comma-separated extra walks profiling the non-decode steps")  # fmt: skip
    ap.add_argument("--top", type=int, default=40, help="cProfile rows kept per step")
    ap.add_argument("--lean-ab", type=int, default=0, metavar="ROUNDS",
                    help="walk ROUNDS times each with the lean Triton launches off / on")  # fmt: skip
    ap.add_argument("--small", default="8,64,512",
                    help="prompt lengths of the small eager steps timed after the walks")  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's max_model_len (default: the workload's length)")  # fmt: skip
    ap.add_argument("--no-tiers", action="store_true",
                    help="decode graphs: one per bucket for max_model_len, no context tiers")  # fmt: skip
    ap.add_argument("--warmup", choices=("on", "off"), default=None,
                    help="the engine's warmup at construction (default: the engine's, on "
                    "with CUDA)")  # fmt: skip
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    n = args.num_requests or (16 if cuda else 4)
    p = args.prompt_len or (4096 if cuda else 64)
    new = args.new_tokens or (128 if cuda else 8)
    budget = args.max_num_batched_tokens if cuda else min(args.max_num_batched_tokens, 2 * p)
    record = {
        "bench": "hybrid_steps",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "workload": {"requests": n, "prompt_len": p, "new_tokens": new,
                     "max_num_batched_tokens": budget, "kv_format": args.kv_format},
    }  # fmt: skip
    max_len = max(args.max_model_len, p + new + 8)
    record["workload"]["max_model_len"] = max_len
    if args.no_tiers:
        os.environ["KVPLAN_HYBRID_GRAPH_TIERS"] = "0"
    with tempfile.TemporaryDirectory() as folder:
        vocab = build_folder(folder, not cuda, max(4096, p + new + 64, max_len), dev)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (n, p), generator=gen).tolist()
        kv = args.kv_format if cuda else args.kv_format.replace("bf16", "fp32")
        t_build = time.perf_counter()
        warm = None if args.warmup is None else args.warmup == "on"
        # prefix caching off: each walk of the same prompts computes every prompt token,
        # in the steps of the sessions before it (no chunk ends at resume boundaries)
        llm = LLM(
            folder, device=dev.type, dtype="bfloat16" if cuda else "float32", kv_format=kv,
            max_num_seqs=n, max_model_len=max_len, max_num_batched_tokens=budget,
            warmup=warm, enable_prefix_caching=False,
        )  # fmt: skip
        rep = llm.warmup_report
        record["build_s"] = time.perf_counter() - t_build
        record["warmup"] = None if rep is None else {
            "seconds": rep.seconds, "steps": rep.num_steps, "requests": rep.num_requests}  # fmt: skip
        graphs = llm.engine.runner.graphs
        if graphs is not None and hasattr(graphs, "tier_graphs"):
            record["graphs"] = {"tiers": graphs.tiers, "buckets": graphs.buckets,
                                "captured": len(graphs.graphs) + len(graphs.tier_graphs)}  # fmt: skip
        if cuda:
            record["memory_reserved_gib"] = torch.cuda.memory_reserved(dev) / 2**30
        print(f"engine built in {record['build_s']:.1f} s (warmup: "
              f"{'off' if rep is None else f'{rep.seconds:.1f} s, {rep.num_steps} steps'}; "
              f"graphs {record.get('graphs')})")  # fmt: skip
        llm.generate(ids, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        sync(dev)
        t0 = time.perf_counter()
        record["steps"] = walk(llm, ids, new, dev, "")
        record["wall_s"] = time.perf_counter() - t0
        print(f"warm run: {record['wall_s']:.3f} s, {len(record['steps'])} steps")
        summarize(record["steps"])
        if args.lean_ab:
            record["lean_ab"] = lean_ab(llm, ids, new, dev, args.lean_ab)
        for prof in filter(None, args.profile.split(",")):
            record[f"steps_{prof}"] = [
                s for s in walk(llm, ids, new, dev, prof, args.top) if s["prompt_tokens"]
            ]
            print(f"profiled ({prof}):")
            summarize(record[f"steps_{prof}"])
        small = []
        for length in (int(x) for x in args.small.split(",") if x):
            walls = time_prompt(llm, ids[0][:length], dev)
            small.append({"prompt_tokens": length, "ms_runs": walls, "ms_min": min(walls)})
            print(f"one {length}-token prompt alone (1 step + request setup): first "
                  f"{walls[0]:.1f} ms (compiles for its sizes land here), then min "
                  f"{min(walls[1:]):.2f} ms of {', '.join(f'{w:.1f}' for w in walls[1:])}")  # fmt: skip
        record["small_prompts"] = small
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
