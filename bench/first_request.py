"""First-request latency of a dense engine with the warmup off or on (`kvplan.engine.warmup`).

Builds `LLM(model, warmup=...)` (timed: the build, and the warmup within it), runs a warm
workload (``--num-requests`` prompts of ``--prompt-len`` tokens, ``--new-tokens`` each), then
one prompt alone of each ``--small`` length, five times: the first run is where compiles and
other first uses of that size land, the other four are its steady state. Run it once per
setting in fresh processes (compiles are per process; ``TRITON_CACHE_DIR`` decides whether
they come from disk). `bench/hybrid_steps.py --warmup` does the same for DeepSeek-V4.

GPU:  PYTHONPATH=. python3 bench/first_request.py --warmup on --out first_on.json
CPU:  PYTHONPATH=. python3 bench/first_request.py --quick --warmup on --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from kvplan import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid_hf import sync  # noqa: E402
from hybrid_steps import time_prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: random:llama-1b (GPU), "
                    "random:tiny-llama (--quick)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--warmup", choices=("on", "off"), required=True)
    ap.add_argument("--kv-format", default="auto")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--small", default="8,100,700", help="prompt lengths timed alone after")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    model = args.model or ("random:llama-1b" if cuda else "random:tiny-llama")
    n = args.num_requests or (64 if cuda else 4)
    p = args.prompt_len or (256 if cuda else 16)
    new = args.new_tokens or (128 if cuda else 4)
    small = [int(x) for x in args.small.split(",") if x]
    max_len = args.max_model_len or (2048 if cuda else max(64, p + new + 8, max(small) + 8))
    kv = args.kv_format
    t0 = time.perf_counter()
    llm = LLM(model, device=dev.type, kv_format=kv, max_model_len=max_len, max_num_seqs=n,
              warmup=args.warmup == "on")  # fmt: skip
    build_s = time.perf_counter() - t0
    rep = llm.warmup_report
    print(f"engine built in {build_s:.1f} s (warmup: "
          f"{'off' if rep is None else f'{rep.seconds:.1f} s, {rep.num_steps} steps'})")  # fmt: skip
    vocab = llm.parts.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, p), generator=gen).tolist()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sync(dev)
    t0 = time.perf_counter()
    llm.generate(ids, params)
    sync(dev)
    warm_s = time.perf_counter() - t0
    print(f"warm workload ({n} x {p} x {new}): {warm_s:.3f} s")
    rows = []
    for length in small:
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        walls = time_prompt(llm, prompt, dev)
        rows.append({"prompt_tokens": length, "ms_runs": walls, "first_ms": walls[0],
                     "ms_min_after": min(walls[1:])})  # fmt: skip
        print(f"one {length}-token prompt alone: first {walls[0]:.1f} ms, then min "
              f"{min(walls[1:]):.2f} ms of {', '.join(f'{w:.1f}' for w in walls[1:])}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({
            "bench": "first_request",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "command": " ".join([sys.executable, *sys.argv]),
            "model": model, "kv_format": kv, "max_model_len": max_len,
            "workload": {"requests": n, "prompt_len": p, "new_tokens": new},
            "build_s": build_s,
            "warmup": None if rep is None else {"seconds": rep.seconds, "steps": rep.num_steps,
                                                "requests": rep.num_requests},
            "warm_workload_s": warm_s,
            "small_prompts": rows,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
