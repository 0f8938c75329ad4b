"""Requests that share a system prompt and arrive together (dense models): the prefix cache
off, on without waiting, and on with ``wait_for_shared_prefix`` (the default), side by side
in one process.

Workload: ``--rounds`` rounds; each round sends ``--requests`` prompts at once, each a fresh
system prompt of ``--system-len`` random tokens (new in every round, so nothing is cached
when a round starts) plus its own ``--question-len`` tokens, ``--new-tokens`` each (greedy,
EOS ignored). Per engine and round: the wall time of the whole round, the time until every
request has its first token (the same prompts with ``max_tokens=1``, another fresh system
prompt), and the prompt tokens the engine computed (prompt tokens less the prefix-cache hits).
Without waiting every request admitted in the same step as the first computes the system
prompt again; with it, the others wait one step and reuse its blocks.

The model is any `kvplan.LLM` model (default: random ``llama-1b`` in bf16 on CUDA,
``random:tiny-llama`` in fp32 on the CPU); each engine warms up as `LLM` does by default.

GPU:  PYTHONPATH=. python3 bench/shared_prefix.py --out shared.json
CPU:  PYTHONPATH=. python3 bench/shared_prefix.py --quick --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_hf import sync  # noqa: E402

VARIANTS = {  # name -> (enable_prefix_caching, wait_for_shared_prefix)
    "off": (False, False),
    "nowait": (True, False),
    "wait": (True, True),
}


def run_round(llm: LLM, prompts: list[list[int]], new: int, dev: torch.device) -> dict:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sync(dev)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(dev)
    wall = time.perf_counter() - t0
    hits = [o.num_cached_prefix_tokens for o in outs]
    return {
        "wall_s": wall,
        "computed_prompt_tokens": sum(len(p) for p in prompts) - sum(hits),
        "hit_tokens": hits,
        "tokens": [o.token_ids for o in outs],
    }


def prompts(g: torch.Generator, vocab: int, n: int, system_len: int, qlen: int) -> list:
    """``n`` prompts: one fresh random system prompt, then each its own random tokens."""
    system = torch.randint(0, vocab, (system_len,), generator=g).tolist()
    return [system + torch.randint(0, vocab, (qlen,), generator=g).tolist() for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument(
        "--model",
        default=None,
        help="any LLM model; 'default' = SmolLM2-135M-Instruct (the package's)",
    )
    ap.add_argument("--kv-format", default="auto")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--question-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    model = args.model or ("random:llama-1b" if cuda else "random:tiny-llama")
    model_arg = None if model == "default" else model
    nreq = args.requests or (32 if cuda else 8)
    system_len = args.system_len or (2000 if cuda else 200)
    qlen = args.question_len or (100 if cuda else 20)
    new = args.new_tokens or (64 if cuda else 8)
    budget = args.max_num_batched_tokens or (16384 if cuda else 2048)
    g = torch.Generator().manual_seed(0)
    results: dict = {}
    for name, (caching, wait) in VARIANTS.items():
        llm = LLM(model_arg, device=dev.type, dtype="bfloat16" if cuda else "float32",
                  kv_format=args.kv_format, max_num_seqs=nreq,
                  max_model_len=system_len + qlen + new + 16, max_num_batched_tokens=budget,
                  enable_prefix_caching=caching, wait_for_shared_prefix=wait)  # fmt: skip
        vocab = llm.parts.config.vocab_size
        g.manual_seed(0)  # every engine gets the same prompts

        rounds, firsts = [], []
        for _ in range(args.rounds):
            rounds.append(run_round(llm, prompts(g, vocab, nreq, system_len, qlen), new, dev))
            firsts.append(
                run_round(llm, prompts(g, vocab, nreq, system_len, qlen), 1, dev)["wall_s"]
            )
        results[name] = {
            "rounds": rounds,
            "first_token_s": firsts,
            "median_round_s": statistics.median(r["wall_s"] for r in rounds),
            "median_first_token_s": statistics.median(firsts),
            "prefix_waits": llm.engine.scheduler.num_prefix_waits,
        }
        r = results[name]
        print(f"{name:7s}: round {r['median_round_s'] * 1e3:8.1f} ms, all first tokens "
              f"{r['median_first_token_s'] * 1e3:8.1f} ms (medians of {args.rounds}), prompt "
              f"tokens computed {rounds[0]['computed_prompt_tokens']} of "
              f"{nreq * (system_len + qlen)}, waits {r['prefix_waits']}")  # fmt: skip
        llm.close()
        del llm
        if cuda:
            torch.cuda.empty_cache()
    base = results["off"]["rounds"]
    summary = {
        f"{name}_{what}_speedup": results["off"][key] / results[name][key]
        for name in ("nowait", "wait")
        for what, key in (("round", "median_round_s"), ("first_token", "median_first_token_s"))
    }
    summary.update({
        f"{name}_tokens_equal": [r["tokens"] for r in results[name]["rounds"]]
        == [r["tokens"] for r in base]
        for name in ("nowait", "wait")
    })  # fmt: skip
    print(json.dumps(summary, indent=1))
    record = {
        "bench": "shared_prefix",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "workload": {
            "model": model,
            "requests": nreq,
            "system_len": system_len,
            "question_len": qlen,
            "new_tokens": new,
            "rounds": args.rounds,
            "max_num_batched_tokens": budget,
            "kv_format": args.kv_format,
        },  # fmt: skip
        "summary": summary,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
