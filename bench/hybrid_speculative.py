"""DeepSeek-V4 speculative decoding (n-gram drafts) against plain decoding, one engine each, on
the same prompts: output tokens/s, steps, drafts proposed and accepted, and whether the
tokens are equal (they must be: greedy).

The model is a tiny random DeepSeek-V4 (`tests/models/dsv4_testlib.hf_config`, all three
layer kinds) saved by HF; the prompts repeat a short random phrase, so the n-gram proposer
finds matches, and a random model's greedy output often falls into loops, which the drafts
then continue. Runs alternate (plain, drafts, plain, ...) and the medians are reported.

CPU:  PYTHONPATH=. python3 bench/hybrid_speculative.py --out spec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams
from tests.models.dsv4_testlib import random_tokens, saved_folder


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts, each a random phrase of 3-7 tokens (vocabulary of 12) repeated."""
    return [random_tokens(seed + i, 3 + i % 5, vocab=12) * (4 + i % 3) for i in range(n)]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict:
    steps = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    dt = time.perf_counter() - t0
    new = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": dt,
        "tok_s": new / dt,
        "steps": llm.engine.num_steps - steps,
        "proposed": sum(o.num_draft_tokens_proposed for o in outs),
        "accepted": sum(o.num_draft_tokens_accepted for o in outs),
        "tokens": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the model's config seed")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp()) / "dsv4"
    saved_folder(args.seed, folder)
    batch = prompts(args.requests, 100 * args.seed)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=256, max_num_seqs=args.requests, warmup=False)
    engines = {
        "plain": LLM(str(folder), **kw),
        "drafts": LLM(str(folder), num_speculative_tokens=args.drafts, **kw),
    }
    for llm in engines.values():  # first-call costs out of the timed runs
        llm.generate(batch[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, llm in engines.items():
            results[name].append(run(llm, batch, params))
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "tok_s_median": statistics.median(r["tok_s"] for r in runs),
            "tok_s_runs": [round(r["tok_s"], 1) for r in runs],
            "steps": runs[0]["steps"],
            "proposed": runs[0]["proposed"],
            "accepted": runs[0]["accepted"],
        }
    same = results["plain"][0]["tokens"] == results["drafts"][0]["tokens"]
    plain, drafts = summary["plain"], summary["drafts"]
    print(f"tiny DeepSeek-V4 (seed {args.seed}), {args.requests} requests x "
          f"{args.new_tokens} new tokens, CPU, {args.runs} alternating runs")  # fmt: skip
    for name, s in summary.items():
        print(f"{name:7} {s['tok_s_median']:8.1f} tok/s (runs {s['tok_s_runs']}), "
              f"{s['steps']} steps, drafts {s['accepted']} / {s['proposed']} accepted")  # fmt: skip
    print(f"speed-up {drafts['tok_s_median'] / plain['tok_s_median']:.2f}x, tokens equal: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "tokens_equal": same}, f, indent=1)


if __name__ == "__main__":
    main()
