"""DeepSeek-V4 prefix caching: shared system prompts and conversations with the cache off and
on, side by side in one process (`bench/bench_hybrid.py`'s model, random bf16 weights on the
GPU; the tiny model in fp32 with ``--quick``).

Two workloads, each run by a fresh engine with ``enable_prefix_caching`` off, then one with it
on (same weights, greedy):

* ``system``: a system prompt of ``--system-len`` tokens, then ``--questions`` requests, each
  the system prompt plus its own ``--question-len`` tokens, ``--new-tokens`` each, all at
  once. With the cache on, the system prompt is first sent alone with ``max_tokens=1``
  (``prime_s``: the step that leaves the snapshot the questions resume from; it also runs, and
  is timed, with the cache off). Reported: the wall time of the questions, and the time to
  the first token of one more question alone afterwards (``ttft_s``, median of 3).
* ``rounds``: ``--rounds`` rounds of ``--questions`` new questions after the same system
  prompt, never sent alone, all of a round's questions at once. With the cache on
  (``wait_for_shared_prefix``, the default) round 1's first question computes the system
  prompt and ends a chunk where the shared blocks end; the others wait for those blocks and
  resume there. A third engine runs the rounds with the cache on but no waiting (``nowait``):
  there round 1 computes the system prompt in every question, round 2 finds its blocks but
  no state at their end (it recomputes them and leaves a snapshot there), later rounds
  resume. Reported: each round's wall time and hits.
* ``conversation``: ``--turns`` turns of one request; each prompt is the last prompt, its
  output and ``--question-len`` new tokens. Reported: each turn's wall time.

Both report the prefix-cache hit tokens and whether the outputs with the cache equal those
without it (bf16 on the GPU may differ where the batch composition changes the rounding).
The warm-up (`kvplan.engine.warmup`, on with CUDA) runs at each engine's construction.

GPU:  PYTHONPATH=. python3 bench/hybrid_prefix_cache.py --out prefix.json
CPU:  PYTHONPATH=. python3 bench/hybrid_prefix_cache.py --quick --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_hf import sync  # noqa: E402
from hybrid_steps import build_folder  # noqa: E402


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, dev) -> tuple[float, list]:
    sync(dev)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(dev)
    return time.perf_counter() - t0, outs


def run_system(llm: LLM, system, questions, extra, new: int, dev) -> dict:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prime_s, _ = timed(llm, [system], one, dev)
    wall, outs = timed(llm, [system + q for q in questions], params, dev)
    ttft = [timed(llm, [system + extra], one, dev)[0] for _ in range(3)]
    return {
        "prime_s": prime_s,
        "questions_wall_s": wall,
        "ttft_s": statistics.median(ttft),
        "ttft_runs_s": ttft,
        "hit_tokens": [o.num_cached_prefix_tokens for o in outs],
        "tokens": [o.token_ids for o in outs],
    }


def run_rounds(llm: LLM, system, rounds, new: int, dev) -> dict:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    walls, hits, tokens = [], [], []
    for questions in rounds:
        wall, outs = timed(llm, [system + q for q in questions], params, dev)
        walls.append(wall)
        hits.append([o.num_cached_prefix_tokens for o in outs])
        tokens.append([o.token_ids for o in outs])
    return {"round_wall_s": walls, "hit_tokens": hits, "tokens": tokens}


def run_conversation(llm: LLM, first, additions, new: int, dev) -> dict:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prompt, walls, hits, tokens = list(first), [], [], []
    for add in additions:
        wall, (out,) = timed(llm, [prompt], params, dev)
        walls.append(wall)
        hits.append(out.num_cached_prefix_tokens)
        tokens.append(out.token_ids)
        prompt = prompt + out.token_ids + add
    return {"turn_wall_s": walls, "hit_tokens": hits, "prompt_lens_end": len(prompt),
            "tokens": tokens}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--question-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    # not block-aligned, and questions long enough that a prompt's own last block boundary
    # lies past the shared part: the rounds then show the adaptive cut at the shared end
    system_len = args.system_len or (4000 if cuda else 41)
    nq = args.questions or (16 if cuda else 3)
    qlen = args.question_len or (200 if cuda else 20)
    new = args.new_tokens or (64 if cuda else 4)
    turns = args.turns or (6 if cuda else 3)
    budget = args.max_num_batched_tokens or (8192 if cuda else 64)
    max_len = max(system_len + qlen + new, turns * (qlen + new) + system_len) + 16
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        vocab = build_folder(folder, not cuda, max_len, dev)

        def tokens(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        system = tokens(system_len)
        questions = [tokens(qlen) for _ in range(nq)]
        extra = tokens(qlen)
        additions = [tokens(qlen) for _ in range(turns)]
        other = tokens(system_len)  # the rounds' system prompt (not the primed one)
        rounds = [[tokens(qlen) for _ in range(nq)] for _ in range(args.rounds)]
        first = system + tokens(qlen)
        results = {}
        for key in ("off", "nowait", "on"):
            llm = LLM(folder, device=dev.type, dtype="bfloat16" if cuda else "float32",
                      kv_format=args.kv_format, max_num_seqs=nq, max_model_len=max_len,
                      max_num_batched_tokens=budget, enable_prefix_caching=key != "off",
                      wait_for_shared_prefix=key == "on")  # fmt: skip
            if key == "nowait":  # waiting changes only the rounds (nothing else shares a
                # prefix with a running request)
                results[key] = {"rounds": run_rounds(llm, other, rounds, new, dev)}
            else:
                results[key] = {
                    "system": run_system(llm, system, questions, extra, new, dev),
                    "rounds": run_rounds(llm, other, rounds, new, dev),
                    "conversation": run_conversation(llm, first, additions, new, dev),
                }
            results[key]["prefix_waits"] = llm.engine.scheduler.num_prefix_waits
            snaps = llm.engine.runner.families["hybrid"].snapshots
            if snaps is not None:
                results[key]["snapshots"] = {
                    "capacity": snaps.capacity,
                    "mib_each": snaps.nbytes_per_snapshot / 2**20,
                    "taken": snaps.num_taken,
                    "restored": snaps.num_restored,
                    "evicted": snaps.num_evicted,
                }
            del llm
            if cuda:
                torch.cuda.empty_cache()
    off, nowait, on = results["off"], results["nowait"], results["on"]
    summary = {
        "questions_speedup": off["system"]["questions_wall_s"] / on["system"]["questions_wall_s"],
        "ttft_speedup": off["system"]["ttft_s"] / on["system"]["ttft_s"],
        "conversation_speedup_per_turn": [
            a / b
            for a, b in zip(off["conversation"]["turn_wall_s"], on["conversation"]["turn_wall_s"])
        ],
        "rounds_speedup": [
            a / b for a, b in zip(off["rounds"]["round_wall_s"], on["rounds"]["round_wall_s"])
        ],
        "rounds_speedup_nowait": [
            a / b for a, b in zip(off["rounds"]["round_wall_s"], nowait["rounds"]["round_wall_s"])
        ],
        "rounds_tokens_equal_nowait": off["rounds"]["tokens"] == nowait["rounds"]["tokens"],
        "system_tokens_equal": off["system"]["tokens"] == on["system"]["tokens"],
        "rounds_tokens_equal": off["rounds"]["tokens"] == on["rounds"]["tokens"],
        "conversation_tokens_equal": off["conversation"]["tokens"] == on["conversation"]["tokens"],
    }
    print("cache on, no waiting: rounds "
          + " ".join(f"{w * 1e3:.0f}" for w in nowait["rounds"]["round_wall_s"])
          + f" ms (hits {[h[:4] for h in nowait['rounds']['hit_tokens']]})")  # fmt: skip
    for key in ("off", "on"):
        s, c = results[key]["system"], results[key]["conversation"]
        print(f"cache {key:3s}: prime {s['prime_s'] * 1e3:8.1f} ms, {nq} questions "
              f"{s['questions_wall_s'] * 1e3:8.1f} ms (hits {s['hit_tokens'][:4]}...), ttft "
              f"{s['ttft_s'] * 1e3:7.1f} ms; turns "
              + " ".join(f"{w * 1e3:.0f}" for w in c["turn_wall_s"])
              + f" ms (hits {c['hit_tokens']}); rounds "
              + " ".join(f"{w * 1e3:.0f}" for w in results[key]["rounds"]["round_wall_s"])
              + f" ms (hits {[h[:4] for h in results[key]['rounds']['hit_tokens']]})")  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    record = {
        "bench": "hybrid_prefix_cache",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "workload": {
            "system_len": system_len,
            "questions": nq,
            "question_len": qlen,
            "new_tokens": new,
            "turns": turns,
            "rounds": args.rounds,
            "max_num_batched_tokens": budget,
            "kv_format": args.kv_format,
            "max_model_len": max_len,
        },  # fmt: skip
        "summary": summary,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
