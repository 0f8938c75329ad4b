"""kvplan against Hugging Face ``generate`` on the CPU, on the packaged SmolLM2-135M (fp32):
output tokens/s of greedy generation, both in one process, medians of ``--runs`` runs, random
prompts, kvplan's prefix cache off (the runs repeat their prompts).

    PYTHONPATH=. python bench/cpu_vs_hf.py [--threads 2] [--runs 3] [--workloads 1x64+64,8x128+64]

Needs the converted model folder (``~/.cache/kvplan/SmolLM2-135M-Instruct``, written by the
first ``kvplan generate``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workloads", default="1x64+64,8x128+64,32x128+64",
                    help="requests x prompt tokens + new tokens, comma separated")  # fmt: skip
    ap.add_argument("--folder", default=os.path.expanduser("~/.cache/kvplan/SmolLM2-135M-Instruct"))
    args = ap.parse_args()

    import transformers as tf

    from kvplan import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.folder, warmup=False, enable_prefix_caching=False)
    hf = tf.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    for spec in args.workloads.split(","):
        n, rest = spec.split("x")
        plen, new = (int(x) for x in rest.split("+"))
        n = int(n)
        prompts = torch.randint(100, 40000, (n, plen), generator=gen)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0, :8].tolist()], SamplingParams(max_tokens=2))  # warm-up
        with torch.no_grad():
            hf.generate(prompts[:1, :8], max_new_tokens=2, do_sample=False)
        kv, h = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            outs = llm.generate(prompts.tolist(), params)
            kv.append(time.perf_counter() - t0)
            with torch.no_grad():
                t0 = time.perf_counter()
                ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0)  # fmt: skip
                h.append(time.perf_counter() - t0)
        same = sum(int(o.token_ids == ref[i, plen:].tolist()) for i, o in enumerate(outs))
        mk, mh = statistics.median(kv), statistics.median(h)
        print(f"{n} x {plen} + {new} new, {args.threads} threads: kvplan {n * new / mk:.1f} "
              f"tok/s, HF generate {n * new / mh:.1f} tok/s: {mh / mk:.2f}x; identical greedy "
              f"outputs {same}/{n}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
