"""Gemma-3-270M-shaped model: kvplan's engine against Hugging Face, and the 8K-context batch
that kvplan's O(window) sliding pools hold against full-length pages.

Model: `kv_memory.gemma3_270m_hf_config` (18 layers, 15 sliding with a 512-token window and 3
full, 4 heads / 1 KV head of 256, vocab 262,144, tied embeddings), random weights (seeded; norm
weights drawn too, so ``1 + w`` is exercised), rounded to bf16 and saved with
``save_pretrained``; kvplan's `kvplan.LLM` loads that folder. ``--quick``: a tiny model of the
same layout on the CPU in fp32 (seconds).

1. Throughput (``--num-requests`` x ``--prompt-len`` random tokens, ``--new-tokens`` greedy
   tokens each, EOS ignored): the HF baselines of ``bench/bench_engine.py`` (``generate`` on
   the batch, ``generate_batch`` with and without CUDA graphs) first, then kvplan (CUDA graphs
   on CUDA); wall, output tokens/s, kvplan / best HF. Also kvplan's and HF's greedy tokens on
   the first ``--check-prompts`` prompts (equal in fp32; bf16 rounds differently).
2. Long context (``--demo-prompt`` + ``--demo-new`` tokens per request, ``--demo-memory`` KV
   bytes, ``--demo-chunk`` tokens per step): the largest batch with window pools and with
   full pages, computed by `kv_memory.report` (the engine's pool sizing). Each is run
   (``sliding_window_kv="window"`` / ``"full"``): that many requests, each of one context
   length, prompts just short enough
   (`demo_prompt_len`) that the first is still decoding when the last finishes its prefill;
   reported are the most requests running at once, the KV tokens they held, the full pool's
   blocks in use, and preemptions (0 when the sizing holds).

``--time-budget`` seconds: a part that would start after it is skipped (recorded as such); the
long-context run stops at it.

    PYTHONPATH=. python3 bench/bench_gemma3.py --out bench/results/gemma3.json   # H200
    PYTHONPATH=. python3 bench/bench_gemma3.py --quick --out /tmp/q.json         # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import free_device_memory, run_hf, timed_workload  # noqa: E402
from kv_memory import gemma3_270m_hf_config, report  # noqa: E402

from kvplan import LLM, SamplingParams  # noqa: E402
from kvplan.engine.cli_bench import make_prompts, sync_device  # noqa: E402
from kvplan.engine.config import add_engine_arguments  # noqa: E402
from kvplan.models.config import ModelConfig  # noqa: E402

QUICK_SHAPES = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, head_dim=32,
                    vocab_size=512, sliding_window=32, max_position_embeddings=1024,
                    initializer_range=0.2)  # fmt: skip
BLOCK_SIZE = 16  # EngineConfig's default, used by both parts


def build_hf(quick: bool, seed: int = 0):
    """HF ``Gemma3ForCausalLM`` on the CPU with random weights, values rounded to bf16."""
    import transformers as tf

    cfg = gemma3_270m_hf_config(**(QUICK_SHAPES if quick else {}))
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zeros by default: 1 + w would be 1
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
    return model.to(torch.bfloat16)


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new: int, dev) -> list[list[int]]:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    ids = torch.tensor(prompts, device=dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[:, ids.shape[1] :].tolist()


def run_kvplan(folder, prompts, check, args, dev, dtype) -> tuple[dict, list[list[int]]]:
    """Timed `run_workload` after a warm-up of the same shapes; then the check prompts."""
    llm, (res,) = timed_workload(folder, args.vocab_size, prompts, args, dev, dtype)
    outs = llm.generate(check, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
    row = {"output_tokens": res.output_tokens, "wall_s": res.wall_s,
           "output_tokens_per_s": res.output_tokens_per_s,
           "median_decode_step_ms": res.median_decode_step_ms, "steps": res.num_steps,
           "graph_replays": res.num_graph_replays, "triton_compiles_in_run": res.triton_compiles,
           "async_scheduling": llm.engine.async_scheduling}  # fmt: skip
    llm.close()
    del llm
    free_device_memory(dev)
    return row, [o.token_ids for o in outs]


def ramp_steps(num_seqs: int, prompt: int, chunk: int) -> float:
    """Steps until the last of ``num_seqs`` prompts of ``prompt`` tokens is prefilled when
    every prefilled request keeps decoding, by the scheduler's budget rule (``chunk`` tokens a
    step: running requests first in arrival order, one token per decoding one, then waiting
    ones admitted first come first served); inf when decoding takes the whole budget."""
    waiting, prefilling, decoding, steps = num_seqs, deque(), 0, 0
    while waiting or prefilling:
        budget, done = chunk - decoding, 0
        if budget <= 0:
            return float("inf")
        while prefilling and budget:
            take = min(prefilling[0], budget)
            budget -= take
            prefilling[0] -= take
            if not prefilling[0]:
                prefilling.popleft()
                done += 1
        while waiting and budget:
            waiting -= 1
            take = min(prompt, budget)
            budget -= take
            if take < prompt:
                prefilling.append(prompt - take)
            else:
                done += 1
        decoding += done
        steps += 1
    return steps


def demo_prompt_len(num_seqs: int, context: int, chunk: int) -> int:
    """Longest prompt (a multiple of `BLOCK_SIZE`) for requests of ``context`` tokens in all
    (prompt + max_tokens) whose first request outlives the last one's prefill, with a margin
    of 16 steps + 5%; 0 when none does."""

    def fits(prompt: int) -> bool:
        r = ramp_steps(num_seqs, prompt, chunk)
        return context - prompt >= r + 16 + r / 20

    lo, hi = 0, (context - 1) // BLOCK_SIZE  # in blocks; fits(lo * BLOCK_SIZE) assumed
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * BLOCK_SIZE) else (lo, mid - 1)
    return lo * BLOCK_SIZE


def run_long_context(folder, mcfg, args, dev, dtype, deadline) -> dict:
    """Part 2 (module docstring): the computed batches, then one run per ``sliding_window_kv``
    setting ("window": O(window) pools; "full": full-length pages) at its computed batch."""
    context = args.demo_prompt + args.demo_new
    kv_format = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    computed = report(mcfg, context=context, block_size=BLOCK_SIZE, kv_format=kv_format,
                      chunk=args.demo_chunk, memory=args.demo_memory)  # fmt: skip
    out = {"context_tokens": context, "memory_bytes": args.demo_memory,
           "chunk_tokens": args.demo_chunk, "computed": computed,
           "max_batch_full_pages_computed": computed["max_batch"]["full_pages"],
           "max_batch_window_pools_computed": computed["max_batch"]["window_pools"],
           "runs": {}}  # fmt: skip
    for mode, key in (("full", "full_pages"), ("window", "window_pools")):
        n = computed["max_batch"][key]
        prompt = demo_prompt_len(n, context, args.demo_chunk) if n else 0
        if not prompt or time.perf_counter() > deadline:
            out["runs"][mode] = "skipped (time budget)" if prompt else "skipped (no prompt fits)"
            continue
        out["runs"][mode] = run_batch(folder, mcfg, args, dev, dtype, deadline, mode, n, prompt)
    return out


def run_batch(folder, mcfg, args, dev, dtype, deadline, mode, n, prompt) -> dict:
    """``n`` requests of ``prompt`` + the rest of the context, sliding layers on ``mode``
    blocks: the most running at once, KV held at the peak, preemptions."""
    context = args.demo_prompt + args.demo_new
    llm = LLM(folder, device=dev.type, dtype=dtype, max_num_seqs=n, max_model_len=context,
              max_num_batched_tokens=args.demo_chunk, kv_cache_memory=args.demo_memory,
              enable_prefix_caching=False, sliding_window_kv=mode)  # fmt: skip
    sizes, manager, core = llm.parts.pool_sizes, llm.parts.manager, llm.engine
    full = sizes.window_sizes.index(None)
    params = SamplingParams(max_tokens=context - prompt, ignore_eos=True)
    preempted0 = core.scheduler.num_preemptions
    sync_device(dev)
    t0 = time.perf_counter()
    reqs = [core.add_request(p, params) for p in make_prompts(n, prompt, mcfg.vocab_size, seed=2)]
    peak_running, peak, steps, stopped = 0, {"kv_tokens_held": 0}, 0, False
    while core.has_unfinished() and not any(r.finished for r in reqs):
        if time.perf_counter() > deadline:
            stopped = True
            break
        core.step()
        steps += 1
        running = core.scheduler.running
        peak_running = max(peak_running, len(running))
        held = sum(r.num_computed_tokens for r in running)
        if running and held > peak["kv_tokens_held"]:
            peak = {"kv_tokens_held": held, "running": len(running),
                    "min_context": min(r.num_computed_tokens for r in running),
                    "mean_context": held / len(running),
                    "full_pool_blocks_used": sizes.num_blocks[full] - 1
                    - manager.num_free_blocks(full)}  # fmt: skip
    for r in reqs:
        core.abort(r.request_id)
    sync_device(dev)
    run = {"sliding_window_kv": mode, "requests": n, "prompt_tokens": prompt,
           "max_tokens": context - prompt, "engine_num_window_seqs": sizes.num_window_seqs,
           "engine_pool_blocks": dict(zip(map(str, sizes.window_sizes), sizes.num_blocks)),
           "steps": steps, "wall_s": time.perf_counter() - t0, "stopped_by_time_budget": stopped,
           "peak_running": peak_running, "at_peak_kv": peak,
           "preemptions": core.scheduler.num_preemptions - preempted0}  # fmt: skip
    run["all_ran_concurrently"] = peak_running == n and run["preemptions"] == 0
    llm.close()
    del llm
    free_device_memory(dev)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--out", required=True)
    add_engine_arguments(ap, ("backend", "max_num_batched_tokens", "async_scheduling",
                              "kv_cache_memory"), max_num_batched_tokens=8192)  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--hf", default=None, help="comma-separated HF baselines ('' = none; "
                    "default: all three, --quick: generate)")  # fmt: skip
    ap.add_argument("--demo-prompt", type=int, default=None, help="context: prompt part")
    ap.add_argument("--demo-new", type=int, default=None, help="context: new-token part")
    ap.add_argument("--demo-memory", type=int, default=None, help="KV bytes of part 2")
    ap.add_argument("--demo-chunk", type=int, default=None, help="tokens per step, part 2")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_budget
    q, cuda = args.quick, torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    for name, quick, full in (("hf", "generate", "generate_batch_cuda_graph,generate_batch,"
                               "generate"), ("num_requests", 4, 64), ("prompt_len", 48, 1024),
                              ("new_tokens", 8, 128), ("demo_prompt", 224, 8192),
                              ("demo_new", 32, 128), ("demo_memory", 3 << 19, 8 << 30),
                              ("demo_chunk", 64, 512)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    hf = build_hf(q)
    mcfg = ModelConfig.from_hf(hf.config)
    args.vocab_size = mcfg.vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, mcfg.vocab_size)
    check = prompts[: args.check_prompts]
    result = {
        "bench": "gemma3",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(argv),
        "model": "tiny gemma3_text (quick)" if q else "gemma-3-270m shapes, random weights",
        "params": sum(p.numel() for p in hf.parameters()),
        "workload": {
            "requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "dtype": str(dtype),
        },  # fmt: skip
        "hf": {},
    }

    def save() -> None:  # after each part: a run stopped from outside keeps what it measured
        result["wall_s"] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        hf = hf.to(dev, dtype)  # bf16 values: exact in fp32
        for mode in [m for m in args.hf.split(",") if m]:
            over = time.perf_counter() > deadline
            result["hf"][mode] = {"skipped": "time budget"} if over else run_hf(hf, prompts, args,
                                                                                dev, mode)  # fmt: skip
        try:
            hf_tokens = hf_greedy(hf, check, args.new_tokens, dev)
        except Exception as exc:  # the check must not cost the measurements
            hf_tokens, result["hf_greedy_error"] = None, repr(exc)[:500]
        del hf
        free_device_memory(dev)
        save()
        if time.perf_counter() > deadline:
            kv, kv_tokens = {"skipped": "time budget"}, None
        else:
            kv, kv_tokens = run_kvplan(folder, prompts, check, args, dev, dtype)
        result["kvplan"] = kv
        best = max((r.get("output_tokens_per_s", 0) for r in result["hf"].values()), default=0)
        rate = kv.get("output_tokens_per_s")
        result["ratio_vs_best_hf"] = rate / best if rate and best else None
        result["greedy_check"] = {"hf_tokens": hf_tokens, "kvplan_tokens": kv_tokens}
        if kv_tokens is not None and hf_tokens is not None:
            pairs = list(zip(kv_tokens, hf_tokens))
            result["greedy_check"].update(
                sequences_equal=sum(a == b for a, b in pairs) / len(pairs),
                first_tokens_equal=sum(a[0] == b[0] for a, b in pairs) / len(pairs),
            )
        save()
        try:
            result["long_context"] = run_long_context(folder, mcfg, args, dev, dtype, deadline)
        except Exception as exc:  # e.g. out of memory: keep part 1's figures
            result["long_context"] = {"error": repr(exc)[:500]}
            save()
            raise
    save()
    print(f"{'system':<34} {'output tok/s':>14} {'wall s':>9}")
    for name, r in [("kvplan", kv), *(("HF " + m, r) for m, r in result["hf"].items())]:
        if "output_tokens_per_s" in r:
            print(f"{name:<34} {r['output_tokens_per_s']:>14,.0f} {r['wall_s']:>9.2f}")
        else:
            print(f"{name:<34} {str(r.get('error') or r.get('skipped'))[:60]}")
    ratio, gc = result["ratio_vs_best_hf"], result["greedy_check"]
    print(f"kvplan / best HF: {'-' if ratio is None else f'{ratio:.2f}x'}; greedy sequences "
          f"equal to HF's: {gc.get('sequences_equal')} (first tokens {gc.get('first_tokens_equal')})")  # fmt: skip
    lc = result["long_context"]
    print(f"{lc['context_tokens']}-token context, {lc['memory_bytes'] / 2**30:.2f} GiB KV: max "
          f"batch full pages {lc['max_batch_full_pages_computed']}, window pools "
          f"{lc['max_batch_window_pools_computed']} (computed by the engine's pool sizing)")  # fmt: skip
    for mode, run in lc["runs"].items():
        if not isinstance(run, dict):
            print(f"  {mode}: {run}")
            continue
        p = run["at_peak_kv"]
        print(f"  {mode}: {run['peak_running']} of {run['requests']} requests running at once, "
              f"{run['preemptions']} preemptions, prompts {run['prompt_tokens']} + "
              f"{run['max_tokens']} new; at peak {p.get('kv_tokens_held', 0):,} KV tokens held "
              f"(mean context {p.get('mean_context', 0):.0f}), {run['wall_s']:.1f} s"
              + (" (stopped by time budget)" if run["stopped_by_time_budget"] else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
