"""DeepSeek-V4 prefix caching: a prompt's state kept inside its chunk (one prefill step) against
the chunk ended at the boundary (two steps), side by side in one engine.

With prefix caching a prompt's state is kept at its last block boundary below its length (and
where a shared prefix ends) so later requests can resume there. Before
`kvplan.engine.hybrid.KEEP_STATE_IN_CHUNK` the scheduler ended the chunk at that boundary and
the family took the snapshot after the step: every prompt longer than a block took one more
(eager) step. Now the snapshot is taken before the step and completed by it.

One engine (`bench/bench_hybrid.py`'s model, random bf16 weights on the GPU; the tiny model
in fp32 with ``--quick``), prefix caching on, the scheduler's ``keep_state_in_chunk`` switched
between rounds (``cut`` / ``keep``, alternating, ``--rounds`` each), greedy, one token out:

* ``new``: a prompt of ``--prompt-len`` new tokens (no cache hit): time to its first token;
* ``resumed``: one question of ``--question-len`` tokens after a ``--system-len``-token system
  prompt primed once per round (the question resumes at the system prompt's last boundary and
  computes the rest, its own last boundary inside): time to its first token.

Reported per setting: median wall ms, the engine steps each request took and the questions'
prefix-cache hits (the same in both settings). Each request is new tokens (nothing of another
request cached); the outputs' equality is the tests' (`tests/engine/test_hybrid_prefix_cache.py`:
the kept snapshot equals a cut chunk's bit for bit).

GPU:  PYTHONPATH=. python3 bench/hybrid_keep_state.py --out keep.json
CPU:  PYTHONPATH=. python3 bench/hybrid_keep_state.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_prefix_cache import timed  # noqa: E402
from hybrid_steps import build_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--question-len", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    prompt_len = args.prompt_len or (1000 if cuda else 45)
    system_len = args.system_len or (4000 if cuda else 41)
    qlen = args.question_len or (200 if cuda else 20)
    max_len = max(prompt_len, system_len + qlen) + 16
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    runs: dict[str, dict[str, list]] = {
        k: {"new_ms": [], "new_steps": [], "resumed_ms": [], "resumed_steps": [], "hits": []}
        for k in ("cut", "keep")
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        vocab = build_folder(folder, not cuda, max_len, dev)

        def tokens(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        llm = LLM(folder, device=dev.type, dtype="bfloat16" if cuda else "float32",
                  kv_format=args.kv_format, max_num_seqs=4, max_model_len=max_len,
                  max_num_batched_tokens=8192 if cuda else 64)  # fmt: skip
        engine = llm.engine
        for r in range(args.rounds):
            for key in ("cut", "keep") if r % 2 == 0 else ("keep", "cut"):
                # new tokens each time: nothing of an earlier request is cached
                prompt, system, question = tokens(prompt_len), tokens(system_len), tokens(qlen)
                engine.scheduler.keep_state_in_chunk = key == "keep"
                row = runs[key]
                before = engine.num_steps
                wall, _ = timed(llm, [prompt], one, dev)
                row["new_ms"].append(wall * 1e3)
                row["new_steps"].append(engine.num_steps - before)
                timed(llm, [system], one, dev)  # primes the system prompt's snapshot
                before = engine.num_steps
                wall, (res,) = timed(llm, [system + question], one, dev)
                row["resumed_ms"].append(wall * 1e3)
                row["resumed_steps"].append(engine.num_steps - before)
                row["hits"].append(res.num_cached_prefix_tokens)
    summary = {}
    for key, row in runs.items():
        summary[key] = {
            "new_ms": statistics.median(row["new_ms"]),
            "new_steps": statistics.median(row["new_steps"]),
            "resumed_ms": statistics.median(row["resumed_ms"]),
            "resumed_steps": statistics.median(row["resumed_steps"]),
            "resumed_hits": row["hits"],
        }
        print(f"{key:4s}: new prompt {summary[key]['new_ms']:7.1f} ms "
              f"({summary[key]['new_steps']:.0f} steps), resumed question "
              f"{summary[key]['resumed_ms']:7.1f} ms ({summary[key]['resumed_steps']:.0f} "
              f"steps, hits {row['hits']})")  # fmt: skip
    summary["hits_equal"] = runs["cut"]["hits"] == runs["keep"]["hits"]
    summary["new_speedup"] = summary["cut"]["new_ms"] / summary["keep"]["new_ms"]
    summary["resumed_speedup"] = summary["cut"]["resumed_ms"] / summary["keep"]["resumed_ms"]
    print(f"speedup: new {summary['new_speedup']:.2f}x, resumed "
          f"{summary['resumed_speedup']:.2f}x")  # fmt: skip
    record = {
        "bench": "hybrid_keep_state",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "workload": {
            "prompt_len": prompt_len,
            "system_len": system_len,
            "question_len": qlen,
            "rounds": args.rounds,
            "kv_format": args.kv_format,
        },  # fmt: skip
        "summary": summary,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
