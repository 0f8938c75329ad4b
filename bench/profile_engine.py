"""Where one full-batch decode step of the engine benchmark spends its time.

Builds the engine benchmark's kvplan ``LLM`` (random-weight 1.2B Llama, 64 requests x 256
prompt tokens, bf16 weights, ``--kv-format`` cache, CUDA-graph decode), brings every request into decode, then reports

* device: the kernels of ``--replays`` replays of the decode CUDA graph (torch.profiler),
  grouped by kernel name: count per step, microseconds per step, share of the step;
* host: a cProfile of ``--steps`` full engine steps (scheduler, inputs, metadata, replay
  launch, sampling, output bookkeeping), top functions by own time.

    PYTHONPATH=. python3 bench/profile_engine.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from kvplan.engine.cli_bench import make_prompts
from kvplan.engine.sampling import SamplingParams
from kvplan.models.config import named_config


def kernel_totals(prof, width: int = 90) -> list[tuple[str, tuple[int, float]]]:
    """The CUDA kernels of a torch.profiler run by name (cut to ``width`` characters):
    ``(name, (launches, microseconds))``, the most time first."""
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:width], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total
    return sorted(((n, (c, us)) for n, (c, us) in kernels.items()), key=lambda kv: -kv[1][1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--backend", default="block_offsets")
    ap.add_argument("--kv-format", default="bf16", help="bf16 | fp8 | fp4 | int8")
    ap.add_argument("--kv-exact-window", type=int, default=0, help="EngineConfig.kv_exact_window")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from kvplan import LLM

    dev = torch.device("cuda")
    cfg = named_config(args.config)
    n = args.num_requests
    llm = LLM(cfg, device=dev, dtype=torch.bfloat16, backend=args.backend, max_num_seqs=n,
              max_num_batched_tokens=8192, max_model_len=args.prompt_len + 400,
              kv_cache_memory=8 << 30, kv_format=args.kv_format,
              kv_exact_window=args.kv_exact_window)  # fmt: skip
    core = llm.engine
    params = SamplingParams(max_tokens=args.steps + 3 * args.replays + 40, ignore_eos=True)
    for p in make_prompts(n, args.prompt_len, cfg.vocab_size):
        core.add_request(p, params)
    while core.scheduler.waiting or any(r.is_prefilling for r in core.scheduler.running):
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    g = core.runner.graphs.graphs[max(core.runner.graphs.graphs)]

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            g.replay()
        torch.cuda.synchronize()
    rows = kernel_totals(prof)
    total = sum(us for _, (_, us) in rows)
    lines = [f"device: {args.replays} replays, kernel time per step {total / args.replays:.1f} us"]
    lines.append(f"{'count/step':>10} {'us/step':>9} {'share':>6}  kernel")
    for name, (cnt, us) in rows:
        lines.append(
            f"{cnt / args.replays:10.1f} {us / args.replays:9.1f} {us / total:6.1%}  {name}"
        )
    t = time.perf_counter()
    for _ in range(args.replays):
        g.replay()
    torch.cuda.synchronize()
    lines.append(f"replay wall per step: {(time.perf_counter() - t) / args.replays * 1e3:.3f} ms")

    step_ms = []
    prof_h = cProfile.Profile()
    for _ in range(args.steps):
        t = time.perf_counter()
        prof_h.enable()
        core.step()
        prof_h.disable()
        step_ms.append((time.perf_counter() - t) * 1e3)
    s = io.StringIO()
    pstats.Stats(prof_h, stream=s).sort_stats("tottime").print_stats(45)
    step_ms.sort()
    lines.append(f"host-profiled step median {step_ms[len(step_ms) // 2]:.3f} ms")
    text = "\n".join(lines) + "\n\n" + s.getvalue()
    print(text)
    tag = "" if args.kv_format == "bf16" else f"_{args.kv_format}"
    tag += f"_w{args.kv_exact_window}" if args.kv_exact_window else ""
    tag += f"_{n}x{args.prompt_len}" if (n, args.prompt_len) != (64, 256) else ""
    with open(os.path.join(args.out, f"profile_engine{tag}.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"profile_engine{tag}.json"), "w") as f:
        json.dump({"kernels": rows, "replays": args.replays}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
