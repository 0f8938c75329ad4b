"""How many Triton kernels a new prompt length makes the engine compile (CPU, no GPU needed).

Triton compiles a kernel once per specialization of its arguments: every int argument equal to
1 becomes a constant, every int or pointer divisible by 16 gets an alignment attribute, and
kvplan's launch plans pick power-of-two tiles from sizes. So a prompt whose token count,
compressed-entry count or block count falls in a class the engine has not seen compiles new
kernels inside the step that meets it (on the H200: an 8-token prompt after the 16 x 4,096
workload took 8.95 s the first time, 25-48 ms after; `bench/hybrid_steps.py`, session 29).

This runs the tiny DeepSeek-V4 model of ``hybrid_steps.py --quick`` (or, ``--model dense``,
the tiny Llama of ``bench_engine.py --quick``) through the engine with
kvplan's Triton kernels forced on the CPU (``KVPLAN_FORCE_TRITON=1``, the interpreter) and
``tests/kernel_record.py`` recording each specialization exactly as Triton's binder computes
it for an sm_90 target; one prompt at a time (max_tokens 2: one prompt step, one decode
step), in the order given. Reported: new specializations per prompt, and per kernel.

    PYTHONPATH=. python3 bench/specializations.py --lengths 5,8,9,16,17,32,33 --out s.json
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
os.environ["KVPLAN_FORCE_TRITON"] = "1"
os.environ.pop("KVPLAN_RECORD_KERNELS", None)  # this run keeps its own record

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybrid_steps import build_folder  # noqa: E402

from kvplan import LLM, SamplingParams  # noqa: E402
from kvplan.models.config import named_config  # noqa: E402
from tests.kernel_record import install  # noqa: E402


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def random_workload(llm, n: int, max_len: int, vocab: int, gen: torch.Generator) -> dict:
    """``n`` greedy requests of random lengths (1..max_len) and 1-4 new tokens, each added at
    a random step of the running loop, so prompts share steps with decode rows."""
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    news = torch.randint(1, 5, (n,), generator=gen).tolist()
    steps, pending = 0, list(zip(lengths, news, strict=True))
    while pending or llm.engine.has_unfinished():
        if pending and (not llm.engine.has_unfinished() or torch.rand(1, generator=gen) < 0.5):
            length, new = pending.pop(0)
            ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
            llm.add_request(ids, SamplingParams(max_tokens=new, ignore_eos=True))
        llm.step()
        steps += 1
    return {"requests": n, "lengths": lengths, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="5,8,9,16,17,23,32,33,40,48",
                    help="prompt lengths, run one after the other in this order")  # fmt: skip
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--model", choices=("dsv4", "dense"), default="dsv4",
                    help="the quick DeepSeek-V4 model or the dense tiny-llama")  # fmt: skip
    ap.add_argument("--layers", type=int, default=None,
                    help="dsv4: only the quick model's first layer and its last LAYERS - 1 (2: "
                    "the hash-routed HCA layer and the CSA layer, every kind of kernel it "
                    "launches, in half the time)")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--record", default=None, help="also keep the specializations (JSON lines)")
    ap.add_argument("--warmup", action="store_true",
                    help="build the engine with warmup=True (kvplan.engine.warmup) first")  # fmt: skip
    ap.add_argument("--random", type=int, default=0,
                    help="then N random requests (lengths 1..--max-len, arriving at random "
                    "steps, so prompts mix with decode rows)")  # fmt: skip
    ap.add_argument("--budget", type=int, default=None,
                    help="max_num_batched_tokens (default max(256, longest prompt))")  # fmt: skip
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "kernels.jsonl"
        install(str(record))
        if args.model == "dense":
            model = named_config("tiny-llama", head_dim_override=64)
            vocab = model.vocab_size
        else:
            model = folder + "/model"
            vocab = build_folder(model, True, max(lengths) + 64, torch.device("cpu"),
                                 args.layers)  # fmt: skip
        budget = args.budget or max(256, max(lengths))
        t0 = time.perf_counter()
        llm = LLM(model, device="cpu", dtype="float32", kv_format=args.kv_format,
                  max_num_seqs=4 if args.random else 2, max_model_len=max(lengths) + 16,
                  max_num_batched_tokens=budget, warmup=args.warmup)  # fmt: skip
        warm = {"specializations": len(read_lines(record)),
                "seconds_cpu": time.perf_counter() - t0}  # fmt: skip
        print(f"engine built{' and warmed up' if args.warmup else ''}: "
              f"{warm['specializations']} specializations")  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        rows = []
        for n in lengths:
            before = len(read_lines(record))
            t0 = time.perf_counter()
            llm.generate([torch.randint(0, vocab, (n,), generator=gen).tolist()], params)
            lines = read_lines(record)
            new = collections.Counter(x["name"] for x in lines[before:])
            rows.append({"prompt_tokens": n, "new": len(lines) - before, "by_kernel": new,
                         "seconds_cpu": time.perf_counter() - t0})  # fmt: skip
            print(f"prompt {n:4d}: {len(lines) - before:3d} new specializations "
                  f"({', '.join(f'{k} {v}' for k, v in new.most_common(4))})")  # fmt: skip
        mixed = None
        if args.random:
            before = len(read_lines(record))
            mixed = random_workload(llm, args.random, max(lengths), vocab, gen)
            lines = read_lines(record)
            mixed["new"] = len(lines) - before
            mixed["by_kernel"] = collections.Counter(x["name"] for x in lines[before:])
            print(f"random workload ({args.random} requests, {mixed['steps']} steps): "
                  f"{mixed['new']} new specializations ({dict(mixed['by_kernel'])})")  # fmt: skip
        total = collections.Counter(x["name"] for x in read_lines(record))
        if args.record:
            Path(args.record).write_text(record.read_text())
    print(f"total: {sum(total.values())} specializations of {len(total)} kernels")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "bench": "specializations",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "kv_format": args.kv_format,
            "model": args.model,
            "warmup": args.warmup,
            "layers": args.layers,
            "after_build": warm,
            "prompts": rows,
            "random_workload": mixed,
            "per_kernel": dict(total.most_common()),
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
