"""Engine throughput: kvplan vs Hugging Face transformers on a random-weight 1.2B Llama.

Workload (the issue's): 64 requests x 256 random prompt tokens x 128 new tokens (EOS ignored),
bf16, on one GPU. Measured in the same process:

* kvplan ``LLM`` (block_offsets backend, continuous batching, CUDA-graph decode steps);
* HF ``generate_batch`` (paged continuous batching) with
  ``ContinuousBatchingConfig(use_cuda_graph=True)`` and ``(use_cuda_graph=False)``;
* HF plain ``generate()`` on the padded batch.

Fairness: by default (``--order hf-first``) the HF baselines run first, each after the
previous one's memory is released; kvplan's LLM is built only afterwards. The JSON records
the order and the device memory this process held before each system started.

Also: kvplan's median full-batch decode step against the floor of reading every weight once
(weight bytes / device copy bandwidth measured here), and the share of a decode step's wall
time spent outside GPU kernels (torch.profiler: 1 - kernel time / wall time).

    PYTHONPATH=. python3 bench/bench_engine.py --out results.json          # H200
    PYTHONPATH=. python3 bench/bench_engine.py --quick --out /tmp/q.json   # CPU smoke run

``--kv-format fp8`` / ``int8`` / ``fp4`` run kvplan on a quantized KV cache (a model whose head_dim is
not a multiple of 32, such as the ``--quick`` tiny Llama, gets head_dim 64: whole scale
groups); ``--kv-cache-memory`` sets kvplan's KV pool in bytes (default 8 GiB on CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time

import torch

from kvplan.cache.kv_tensors import QUANTIZED_KV_FORMATS
from kvplan.engine.cli_bench import make_prompts, run_workload, sync_device
from kvplan.engine.config import EngineConfig, add_engine_arguments, config_from_args
from kvplan.models.config import named_config


def hf_config(cfg):
    from transformers import LlamaConfig

    r = cfg.rope
    rope = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "llama3":
        rope.update(factor=r.factor, low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)  # fmt: skip
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def copy_bandwidth(dev, nbytes=2 << 30, reps=10) -> float | None:
    """Device copy bandwidth in bytes/s, counting the read and the write."""
    if dev.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(dev)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync_device(dev)
    bw = 2 * nbytes * reps / (time.perf_counter() - t)
    del src, dst
    return bw


def kernel_share(llm, prompts, dev, steps=10) -> float | None:
    """1 - (GPU kernel time / wall time) over ``steps`` full-batch decode steps."""
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from kvplan.engine.sampling import SamplingParams

    core = llm.engine
    for p in prompts:
        core.add_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(r.is_prefilling or not r.output_token_ids for r in core.scheduler.running) or (
        core.scheduler.waiting
    ):
        core.step()
    core.step()
    sync_device(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync_device(dev)
        wall = time.perf_counter() - t
    while core.has_unfinished():
        core.step()
    kernel_us = sum(
        e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
    )
    return max(0.0, 1.0 - kernel_us * 1e-6 / wall)


def graph_replay_ms(llm, rows: int) -> float | None:
    """Median device time of the timed run's decode-graph replays of ``rows`` rows (the full
    batch): CUDA events around each replay inside the workload's own steps
    (``DecodeGraphs.replay_events``, set by `timed_workload`), so the step's real metadata and
    context lengths; None without graphs or such steps."""
    graphs = llm.engine.runner.graphs
    times = graphs.replay_device_ms(rows) if hasattr(graphs, "replay_device_ms") else []
    return statistics.median(times) if times else None


def _guard(fn, *args):
    """A secondary measurement must not cost the main one: report failures, return None."""
    try:
        return fn(*args)
    except Exception as exc:
        print(f"bench_engine: {fn.__name__} failed: {exc!r}", file=sys.stderr)
        return None


def timed_workload(model, vocab_size: int, prompts, args, dev, dtype, repeats: int = 1):
    """``(llm, results)``: kvplan's `LLM` over ``model`` (a config or a folder) sized for the
    workload, warmed up on the whole workload with other tokens, then ``run_workload`` of
    ``prompts`` timed, and ``repeats - 1`` more timed runs of the same shape with other random
    prompts (seeds 100, 101, ...: no prefix of one run's prompts is cached from another's).
    Each result lists the Triton compiles its run still hit."""
    from kvplan import LLM

    config = config_from_args(
        args, device=dev, dtype=dtype, max_num_seqs=len(prompts),
        max_model_len=args.prompt_len + args.new_tokens + 32,
        kv_cache_memory=args.kv_cache_memory or ((8 << 30) if dev.type == "cuda" else (256 << 20)),
    )  # fmt: skip
    llm = LLM(model, config)
    warm = make_prompts(len(prompts), args.prompt_len, vocab_size, seed=1)
    # the whole workload's shapes: Triton compiles a kernel per argument specialization on
    # first use (row counts, context lengths a decode step passes through): none of those
    # may fall inside the timed run (run_workload lists any that still do)
    warm_res = run_workload(llm, warm, args.new_tokens, progress=False)
    graphs = llm.engine.runner.graphs
    if graphs is not None and hasattr(graphs, "replay_events"):
        graphs.replay_events = []  # device time of each replay (`graph_replay_ms`)
    results = []
    for i in range(repeats):
        run = prompts if i == 0 else make_prompts(len(prompts), len(prompts[0]), vocab_size,
                                                  seed=99 + i)  # fmt: skip
        res = run_workload(llm, run, args.new_tokens, progress=False)
        if res.triton_compiles:
            print(f"bench_engine: {len(res.triton_compiles)} Triton compiles inside timed run "
                  f"{i + 1} (after {len(warm_res.triton_compiles)} in the warm-up), e.g. "
                  f"{res.triton_compiles[0][:160]}", file=sys.stderr)  # fmt: skip
        results.append(res)
    return llm, results


def median_run(results):
    """The run of median wall time (the lower middle of an even count) and the median of
    every run's full-batch decode steps together (None without any)."""
    ranked = sorted(results, key=lambda r: r.wall_s)
    steps = [ms for r in results for ms in r.decode_step_ms]
    return ranked[(len(ranked) - 1) // 2], (statistics.median(steps) if steps else None)


def run_kvplan(cfg, prompts, args, dev, dtype):
    llm, results = timed_workload(cfg, cfg.vocab_size, prompts, args, dev, dtype,
                                  repeats=args.repeats)  # fmt: skip
    res, step = median_run(results)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.parts.model.parameters())
    replay_ms = _guard(graph_replay_ms, llm, len(prompts))
    share = _guard(kernel_share, llm, prompts, dev)
    out = {
        "output_tokens": res.output_tokens, "wall_s": res.wall_s,
        "output_tokens_per_s": res.output_tokens_per_s,
        "median_decode_step_ms": step,
        "num_decode_steps_timed": sum(len(r.decode_step_ms) for r in results),
        "graph_replays": res.num_graph_replays, "steps": res.num_steps,
        "triton_compiles_in_run": [c for r in results for c in r.triton_compiles],
        "steps_by_kind": res.steps_by_kind_summary(),
        "async_scheduling": llm.engine.async_scheduling,
        "steps_launched_ahead": llm.engine.num_steps_ahead,
        "weight_bytes": weight_bytes, "share_outside_gpu_kernels": share,
        "graph_replay_ms": replay_ms,
        "share_outside_gpu_by_replay": (1 - replay_ms / step) if replay_ms and step else None,
        "tensor_parallel_size": llm.config.tensor_parallel_size,  # weight_bytes: rank 0's shard
        **kv_capacity(llm.parts.pool_sizes, len(prompts)),
    }  # fmt: skip
    if len(results) > 1:  # the headline figures are the median run's; every run's here
        out["runs"] = [
            {"output_tokens_per_s": r.output_tokens_per_s, "wall_s": r.wall_s,
             "median_decode_step_ms": r.median_decode_step_ms,
             "steps_by_kind": r.steps_by_kind_summary()}
            for r in results
        ]  # fmt: skip
    llm.close()  # tensor parallelism: stop the worker processes
    del llm
    free_device_memory(dev)
    return out


def kv_capacity(pools, num_requests: int) -> dict:
    """How many of the workload's requests the KV budget holds at once at full length
    (``max_model_len``): the tightest pool's ``(blocks - 1) // blocks_per_seq`` (block 0 is
    padding), at most ``num_requests``. A format whose budget holds fewer runs the rest in a
    later, smaller batch: part of a ratio between formats is then capacity, not speed. Empty
    for models without paged pools (DeepSeek-V4)."""
    if pools is None:
        return {}
    fits = min((n - 1) // per for n, per in zip(pools.num_blocks, pools.blocks_per_seq))
    return {"kv_blocks": list(pools.num_blocks), "blocks_per_request": list(pools.blocks_per_seq),
            "requests_that_fit": min(fits, num_requests)}  # fmt: skip


def free_device_memory(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def device_memory_gib(dev) -> float | None:
    """Device memory held by this process (allocated by torch + reserved), GiB."""
    if dev.type != "cuda":
        return None
    return torch.cuda.memory_reserved(dev) / 2**30


def run_hf_all(cfg, prompts, args, dev, dtype, modes):
    """Every HF baseline on one random-weight model (built once, on the device)."""
    from transformers import LlamaForCausalLM

    if not modes:
        return {}
    with torch.device(dev):
        model = LlamaForCausalLM(hf_config(cfg)).to(dtype).eval()
    try:
        out = {}
        for m in modes:
            free_device_memory(dev)
            mem = device_memory_gib(dev)
            out[m] = run_hf(model, prompts, args, dev, m)
            out[m]["device_memory_in_use_before_gib"] = mem
        return out
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run_hf(model, prompts, args, dev, mode):
    from transformers import GenerationConfig

    def config(n):
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)  # fmt: skip

    gen, warm = config(args.new_tokens), config(4)
    try:
        if mode == "generate":
            ids = torch.tensor(prompts, device=dev)
            with torch.no_grad():
                model.generate(ids[:2, :16], generation_config=warm)
                sync_device(dev)
                t = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=gen)  # fmt: skip
                sync_device(dev)
            wall = time.perf_counter() - t
            tokens = int(out.shape[0] * (out.shape[1] - ids.shape[1]))
        else:
            graphs = mode == "generate_batch_cuda_graph"
            try:  # transformers >= 5.x: a separate ContinuousBatchingConfig
                from transformers import ContinuousBatchingConfig

                kw = {"continuous_batching_config": ContinuousBatchingConfig(use_cuda_graph=graphs)}
            except ImportError:  # older releases kept the switch on GenerationConfig
                gen.use_cuda_graph = warm.use_cuda_graph = graphs
                kw = {}
            with torch.no_grad():
                model.generate_batch([p[:16] for p in prompts[:4]], generation_config=warm, **kw)
                sync_device(dev)
                t = time.perf_counter()
                res = model.generate_batch(prompts, generation_config=gen, **kw)
                sync_device(dev)
            wall = time.perf_counter() - t
            tokens = sum(len(o.generated_tokens) for o in res.values())
        return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}
    except Exception as exc:  # record and keep going: the other baselines still count
        return {"error": repr(exc)[:500]}


def host_step_ms(
    cfg, dev, dtype, num_seqs=64, prompt_len=64, steps=150, profile_steps=0, async_scheduling=None
) -> tuple[float, list[dict]]:
    """Median host time of a full-batch decode step: step wall time minus the model call.

    Meant for the CPU (``--host-step``): the model call is timed around the runner's model
    (eager path), so the rest is scheduler, step inputs, metadata ``prepare()``, sampling
    and output bookkeeping. On a GPU with CUDA graphs the model call is not on this path.

    ``profile_steps > 0``: after the timed steps, run that many more under cProfile, with the
    model call replaced by zero logits (host work only), and return per function its calls
    and own time per step (the 25 largest by own time).
    """
    from kvplan import LLM
    from kvplan.engine.sampling import SamplingParams

    config = EngineConfig(device=dev, dtype=dtype, max_num_seqs=num_seqs,
                          max_num_batched_tokens=8192, max_model_len=prompt_len + steps + 64,
                          kv_cache_memory=256 << 20, async_scheduling=async_scheduling)  # fmt: skip
    llm = LLM(cfg, config)
    core = llm.engine
    for p in make_prompts(num_seqs, prompt_len, cfg.vocab_size):
        core.add_request(p, SamplingParams(max_tokens=steps + 32, ignore_eos=True))
    for _ in range(10):  # prefill, then a few decode steps
        core.step()
    inner, spent = core.runner.model, [0.0]

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        spent[0] += time.perf_counter() - t0
        return out

    core.runner.model = timed
    host = []
    for _ in range(steps):
        spent[0] = 0.0
        t = time.perf_counter()
        core.step()
        host.append((time.perf_counter() - t - spent[0]) * 1e3)
    if not profile_steps:
        return statistics.median(host), []

    def zero_logits(input_ids, positions, attention, rows):
        n = input_ids.shape[0] if rows is None else rows.shape[0]
        return torch.zeros(n, cfg.vocab_size, device=dev)

    core.runner.model = zero_logits
    return statistics.median(host), _profile_steps(core, profile_steps)


def cprofile_rows(fn, per: int = 1) -> list[dict]:
    """Run ``fn()`` under cProfile; per function its calls and own / cumulative microseconds,
    divided by ``per`` (e.g. the steps ``fn`` ran), largest own time first."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, ncalls, tottime, cumtime, ..)
    rows = [
        {"function": f"{path.split('/')[-1]}:{line}({name})", "calls_per_step": nc / per,
         "own_us_per_step": tt / per * 1e6, "cum_us_per_step": ct / per * 1e6}
        for (path, line, name), (_, nc, tt, ct, _) in stats.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us_per_step"])


def _profile_steps(core, steps: int) -> list[dict]:
    """cProfile of ``steps`` engine steps: calls and own microseconds per step, top 25."""

    def run():
        for _ in range(steps):
            core.step()

    rows = cprofile_rows(run, steps)
    total_calls = sum(r["calls_per_step"] for r in rows)
    print(f"cProfile of {steps} steps: {total_calls:.0f} function calls per step")
    print(f"{'calls/step':>10} {'own us':>8} {'cum us':>8}  function")
    for r in rows[:25]:
        print(f"{r['calls_per_step']:>10.1f} {r['own_us_per_step']:>8.1f} "
              f"{r['cum_us_per_step']:>8.1f}  {r['function']}")  # fmt: skip
    return [{"total_calls_per_step": total_calls}, *rows[:25]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU-sized run")
    ap.add_argument("--out", required=True)
    add_engine_arguments(
        ap,
        ("device", "backend", "kv_format", "max_num_batched_tokens", "async_scheduling",
         "kv_cache_memory", "tensor_parallel_size", "kv_exact_window"),
        max_num_batched_tokens=8192,
    )  # fmt: skip
    ap.add_argument("--config", default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--hf", default="generate_batch_cuda_graph,generate_batch,generate",
                    help="comma-separated HF baselines ('' = none)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed kvplan runs of the workload (other random prompts after the "
                         "first); the figures are the median run's, the decode step the median "
                         "of every run's full-batch steps, each run in the JSON's runs")  # fmt: skip
    ap.add_argument("--order", choices=("hf-first", "kvplan-first"), default="hf-first",
                    help="which system runs first (the other's memory is freed in between)")  # fmt: skip
    ap.add_argument("--host-step", action="store_true",
                    help="only measure the host time of a decode step (tiny model, CPU)")  # fmt: skip
    ap.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                    help="with --host-step: also cProfile STEPS more steps (calls per step)")  # fmt: skip
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    async_scheduling = config_from_args(args).async_scheduling
    if args.host_step:
        torch.set_num_threads(1)
        dev = torch.device(args.device or "cpu")
        ms, prof = host_step_ms(named_config(args.config or "tiny-llama"), dev, torch.float32,
                                profile_steps=args.host_profile,
                                async_scheduling=async_scheduling)  # fmt: skip
        result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "device": str(dev), "command": " ".join(sys.argv),
                  "median_host_ms_per_decode_step": ms, "batch": 64}  # fmt: skip
        if prof:
            result["host_profile_per_step"] = prof
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"host time per decode step (batch 64, median of 150): {ms:.3f} ms")
        return 0
    q = args.quick
    args.config = args.config or ("tiny-llama" if q else "llama-1b")
    args.num_requests = args.num_requests or (4 if q else 64)
    args.prompt_len = args.prompt_len or (16 if q else 256)
    args.new_tokens = args.new_tokens or (8 if q else 128)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = named_config(args.config)
    if args.kv_format in QUANTIZED_KV_FORMATS and cfg.head_dim % 32:  # whole scale groups
        cfg = named_config(args.config, head_dim_override=64)
    prompts = make_prompts(args.num_requests, args.prompt_len, cfg.vocab_size)

    bw = _guard(copy_bandwidth, dev)
    modes = [m for m in args.hf.split(",") if m]
    # Fairness: every system gets the whole device. HF's continuous batching sizes its paged
    # cache from the free memory, so by default HF runs first, before kvplan allocates its
    # KV pool; either way the other system's memory is released (del, gc, empty_cache) first.
    if args.order == "hf-first":
        hf = run_hf_all(cfg, prompts, args, dev, dtype, modes)
        free_device_memory(dev)
        kv_mem = device_memory_gib(dev)
        kv = run_kvplan(cfg, prompts, args, dev, dtype)
    else:
        kv_mem = device_memory_gib(dev)
        kv = run_kvplan(cfg, prompts, args, dev, dtype)
        hf = run_hf_all(cfg, prompts, args, dev, dtype, modes)
    kv["device_memory_in_use_before_gib"] = kv_mem
    best_cb = max((r.get("output_tokens_per_s", 0) for m, r in hf.items() if "batch" in m),
                  default=0)  # fmt: skip
    best_hf = max((r.get("output_tokens_per_s", 0) for r in hf.values()), default=0)
    floor_ms = kv["weight_bytes"] / bw * 1e3 if bw else None
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "command": " ".join(sys.argv),
        "workload": {
            "config": args.config,
            "params": cfg.num_params,
            "requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "dtype": str(dtype),
        },  # fmt: skip
        "order": args.order,
        "kvplan": kv,
        "hf": hf,
        "copy_bandwidth_GBps": bw / 1e9 if bw else None,
        "weight_read_floor_ms": floor_ms,
        "ratio_vs_best_hf": kv["output_tokens_per_s"] / best_hf if best_hf else None,
        "ratio_vs_hf_generate_batch_best": kv["output_tokens_per_s"] / best_cb if best_cb else None,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'system':<34} {'output tok/s':>14} {'wall s':>9}")
    print(f"{'kvplan (' + args.backend + ')':<34} {kv['output_tokens_per_s']:>14,.0f} "
          f"{kv['wall_s']:>9.2f}")  # fmt: skip
    if "runs" in kv:
        each = ", ".join(f"{r['output_tokens_per_s']:,.0f}" for r in kv["runs"])
        print(f"kvplan runs (output tok/s; the median above): {each}")
    for m, r in hf.items():
        if "error" in r:
            print(f"{'HF ' + m:<34} {'error':>14}  {r['error'][:80]}")
        else:
            print(f"{'HF ' + m:<34} {r['output_tokens_per_s']:>14,.0f} {r['wall_s']:>9.2f}")
    step = kv["median_decode_step_ms"]
    share = kv["share_outside_gpu_kernels"]
    step_txt = "-" if step is None else f"{step:.3f} ms"
    floor_txt = "-" if floor_ms is None else f"{floor_ms:.3f} ms"
    share_txt = "-" if share is None else f"{share:.0%} (profiler)"
    by_replay = kv["share_outside_gpu_by_replay"]
    if by_replay is not None:
        share_txt += f", {by_replay:.0%} (graph replay {kv['graph_replay_ms']:.3f} ms)"
    if "requests_that_fit" in kv:
        print(f"KV: {kv['kv_blocks']} blocks hold {kv['requests_that_fit']} of the "
              f"{args.num_requests} requests at full length ({kv['blocks_per_request']} blocks "
              "each)")  # fmt: skip
    print(f"order: {args.order} (each system's device memory freed before the next runs)")
    print(f"async scheduling: {'on' if kv['async_scheduling'] else 'off'} "
          f"({kv['steps_launched_ahead']} steps launched ahead)")  # fmt: skip
    ratio = result["ratio_vs_best_hf"]
    print(f"kvplan / best HF: {'-' if ratio is None else f'{ratio:.1f}x'}")
    print(
        f"decode step (batch {args.num_requests}): {step_txt}; weight-read floor: {floor_txt}; "
        f"outside GPU kernels: {share_txt}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
