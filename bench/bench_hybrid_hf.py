"""End-to-end throughput of a DeepSeek-V4-shaped model: kvplan's engine against Hugging Face's
``DeepseekV4ForCausalLM`` on the same random weights and the same workload.

Model: ``bench/bench_hybrid.py``'s `model_shape` (hidden 2048, 12 layers in HF's default
order, 7 HCA and 5 CSA, 16 heads x 512 with 64 rotary dims, window 128, ratios 4 / 128, top-k 512,
32 index heads x 128, 16 experts top-2 of 1024, hyper-connections 4). HF's model is built
with random weights, rounded to bf16 and saved with ``save_pretrained`` (bf16); kvplan's
`kvplan.LLM` loads that folder in bf16. HF runs the same bf16-valued weights in fp32 under
bf16 autocast (its bf16 weights fail with a dtype mismatch in transformers 5.17): greedy
``generate`` over the whole batch at once with ``min_new_tokens`` = ``max_new_tokens``.

Workload: ``--num-requests`` random prompts of ``--prompt-len`` token ids, ``--new-tokens``
greedy tokens each, EOS ignored. Reported: wall time and output tokens/s of each, side by
side in one process, and the ratio; kvplan for each ``--kv-formats`` entry (fp8 = V41 FP8
rows, bf16 = exact rows), CUDA graphs on. Also the share of first tokens on which
kvplan (bf16 rows) and HF agree (a sanity check: both round differently in bf16).

GPU:  PYTHONPATH=. python3 bench/bench_hybrid_hf.py --out hf.json
CPU:  PYTHONPATH=. python3 bench/bench_hybrid_hf.py --quick --out q.json   (tiny, seconds)
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import transformers as tf

from kvplan import LLM, SamplingParams
from kvplan.engine.cli_bench import run_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import cprofile_rows  # noqa: E402
from bench_hybrid import model_shape  # noqa: E402


def hf_config(quick: bool, max_len: int, layers: int | None = None) -> tf.DeepseekV4Config:
    """The model of `bench/bench_hybrid.py` (`model_shape`) as HF's config. ``layers`` (>= 2):
    only the model's first layer and its last ``layers - 1`` (the first is hash-routed, the
    last is a CSA layer, so every kind of layer stays)."""
    shape = model_shape(quick)
    if layers is not None:
        if layers < 2:
            raise ValueError(f"layers must be >= 2 (an HCA and a CSA layer), got {layers}")
        kinds = tf.DeepseekV4Config(**shape).layer_types
        shape |= {"num_hidden_layers": layers, "layer_types": kinds[:1] + kinds[1 - layers :]}
    return tf.DeepseekV4Config(
        **shape, max_position_embeddings=max_len, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def run_hf(
    hf, prompts: torch.Tensor, new: int, dev: torch.device, runs: int = 1
) -> tuple[list[float], torch.Tensor]:
    """Seconds of each of ``runs`` timed ``generate`` calls on the whole workload (after a
    small warm-up), and the last call's new tokens."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    walls = []
    with autocast or torch.autocast("cpu", enabled=False):
        hf.generate(prompts[:1, :8], max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(runs):
            sync(dev)
            t0 = time.perf_counter()
            out = hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            sync(dev)
            walls.append(time.perf_counter() - t0)
    return walls, out[:, prompts.shape[1] :].cpu()


def run_kvplan(folder, prompts, new, dev, kv_format, args) -> tuple[float, list[list[int]], dict]:
    n, p = prompts.shape
    llm = LLM(
        folder, device=dev.type, dtype="bfloat16" if dev.type == "cuda" else "float32",
        kv_format=kv_format, max_num_seqs=n, max_model_len=p + new + 8,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = prompts.tolist()
    # warm-up: the whole workload once. Triton compiles one kernel per argument
    # specialization on first use (chunk lengths, row counts, context lengths the decode
    # steps pass through), which must not be timed
    warm = llm.generate(ids, params)  # greedy: the timed run's tokens are the same
    sync(dev)
    # every timed run computes the whole workload: no prompt resumes from the warm-up's
    # cached prefixes (HF's runs have no cache across calls either)
    reset = llm.parts.manager.reset_prefix_cache
    reset()
    info = {}
    if args.split:  # the prompts alone (+ one token): the prefill share of the run
        t0 = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        sync(dev)
        info["prefill_seconds"] = time.perf_counter() - t0
        reset()
    if args.profile_prefill:  # two prompts alone under the profiler: where prefill time goes
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            llm.generate(ids[:2], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            sync(dev)
        reset()
        if args.trace:  # the timeline (host ops, launches, kernels, gaps) for a trace viewer
            os.makedirs(args.trace, exist_ok=True)
            raw = os.path.join(args.trace, f"prefill_{kv_format}.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
        info["prefill_profile"] = {
            key: [
                {"name": e.key[:120], "ms": getattr(e, key) / 1e3, "calls": e.count}
                for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:25]
            ]
            for key in ("self_device_time_total", "cpu_time_total")
        }
    # the timed run, step by step (the engine's own loop, as `LLM.generate` runs it): also
    # the median full-batch decode step and how many steps replayed a CUDA graph
    res = run_workload(llm, ids, new, progress=False)
    wall = res.wall_s
    info.update(steps=res.num_steps, graph_replays=res.num_graph_replays,
                median_decode_step_ms=res.median_decode_step_ms,
                triton_compiles_in_run=res.triton_compiles,
                steps_by_kind=res.steps_by_kind_summary())  # fmt: skip
    if args.cprofile:  # the whole workload again under cProfile: where the host time goes
        reset()
        info["cprofile"] = host_profile(partial(llm.generate, ids, params), dev)
    del llm
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return wall, [o.token_ids for o in warm], info


def host_profile(fn, dev, top: int = 30) -> dict:
    """Run ``fn`` once under cProfile (`bench_engine.cprofile_rows`): its wall time and the
    ``top`` functions by own and by cumulative time (calls and microseconds of the run)."""
    t0 = time.perf_counter()
    rows = cprofile_rows(lambda: (fn(), sync(dev)))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "by_own": rows[:top],
        "by_cum": sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--kv-formats", default="fp8,bf16")
    # 32,768: 2,752.6 tok/s vs 2,468.8 at 16,384 and 2,405.9 at 8,192 (fp8, H200, 2026-12-02
    # 14:25-14:27 UTC, bench/results/h200/s12_e2e_*.json): fewer, larger prompt steps
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face")
    # HF's single timed run moved 13.1-17.3 s between runs of the same workload (H200,
    # 2026-12-02): its best of two is the baseline
    ap.add_argument("--hf-runs", type=int, default=2,
                    help="timed HF runs of the whole workload; the fastest is the baseline")  # fmt: skip
    ap.add_argument(
        "--split",
        action="store_true",
        help="also time the prompts alone (max_tokens=1): the prefill share",
    )
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="profile two prompts alone: top kernels / host ops in the JSON",
    )
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="with --profile-prefill: write its timeline as DIR/prefill_<format>.json.gz "
        "(chrome trace)",
    )
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="run kvplan's workload once more under cProfile: top host functions in the JSON",
    )
    ap.add_argument(
        "--sparse-prompt-tiling",
        default=None,
        help="JSON launch settings of the prompt rows' sparse attention kernel, e.g. "
        '\'{"d_chunk": 64, "pv_split": 4}\' (kvplan.ops.sparse_attention.ONE_PROGRAM_TILING)',
    )
    args = ap.parse_args()
    if args.sparse_prompt_tiling:
        from kvplan.ops import sparse_attention as sa

        sa.ONE_PROGRAM_TILING.update(json.loads(args.sparse_prompt_tiling))
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    n = args.num_requests or (16 if cuda else 2)
    p = args.prompt_len or (4096 if cuda else 40)
    new = args.new_tokens or (128 if cuda else 6)
    if not cuda:
        args.kv_formats = args.kv_formats.replace("bf16", "fp32")
    cfg = hf_config(args.quick or not cuda, max_len=max(4096, p + new + 64))
    torch.manual_seed(0)
    with torch.device(dev):
        hf = tf.DeepseekV4ForCausalLM(cfg).eval()
    hf = hf.to(torch.bfloat16)
    record = {
        "bench": "hybrid_hf",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "params": sum(t.numel() for t in hf.parameters()),
        "workload": {"requests": n, "prompt_len": p, "new_tokens": new},
        "sparse_prompt_tiling": args.sparse_prompt_tiling,
        "runs": [],
    }
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (n, p), generator=gen)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        hf = hf.float()  # the saved bf16 values, run in fp32 under bf16 autocast
        hf_tokens = None
        if not args.no_hf:
            walls, hf_tokens = run_hf(hf, prompts.to(dev), new, dev, args.hf_runs)
            wall = min(walls)  # HF at its best of the timed runs
            peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
            report(record, {"engine": "hf", "seconds": wall, "tok_s": n * new / wall,
                            "all_seconds": walls, "peak_bytes": peak}, args.out)  # fmt: skip
        del hf
        if cuda:
            torch.cuda.empty_cache()
        for fmt in args.kv_formats.split(","):
            wall, toks, info = run_kvplan(folder, prompts, new, dev, fmt, args)
            row = {"engine": "kvplan", "kv_format": fmt, "seconds": wall,
                   "tok_s": n * new / wall, **info}  # fmt: skip
            if hf_tokens is not None:
                row["first_token_agreement"] = (
                    sum(int(t[0] == h[0]) for t, h in zip(toks, hf_tokens.tolist())) / n
                )
            report(record, row, args.out)


def report(record: dict, row: dict, out: str | None) -> None:
    """Append ``row`` to the record, print its line and rewrite the JSON at once (a run cut
    short by a time limit keeps what it measured)."""
    record["runs"].append(row)
    hf_rate = next((r["tok_s"] for r in record["runs"] if r["engine"] == "hf"), None)
    if hf_rate:
        row["vs_hf"] = row["tok_s"] / hf_rate
    r = row
    print(f"{r['engine']:>7} {r.get('kv_format', ''):>9} {r['seconds']:8.2f} s "
          f"{r['tok_s']:10.1f} tok/s" + (f"  {r['vs_hf']:.1f}x HF" if hf_rate else "")
          + (f"  prefill alone {r['prefill_seconds']:.2f} s" if "prefill_seconds" in r else "")
          + (f"  (best of {', '.join(f'{w:.2f}' for w in r['all_seconds'])} s)"
             if len(r.get("all_seconds", ())) > 1 else "")
          + (f"  {r['steps']} steps ({r['graph_replays']} graph replays), median "
             f"decode step {r['median_decode_step_ms']:.2f} ms"
             if r.get("median_decode_step_ms") else ""), flush=True)  # fmt: skip
    if out:
        with open(out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
