"""Hybrid attention benchmark: a random-weight DeepSeek-V4-shaped model decoding on kvplan's
``PlannedHybridFamily`` at long contexts, against its memory floor.

Model (GPU mode): the real attention shapes -- head_dim 512 with 64 rotary dims, one shared
K=V head, window 128, CSA ratio 4 with top-k 512 and 32 indexer heads x 128, HCA ratio 128 --
with the rest scaled down to the issue's 2.05B-parameter anchor: hidden 2048, 12 layers (HCA,
HCA, then CSA / HCA alternating), 16 heads, q / o low rank 512 (8 output groups), 16 experts
top-2 of width 1024, hyper-connections 4, vocab 129280; bf16 weights on CUDA.

Workload: ``batch`` sequences already holding ``context`` tokens, then greedy decode steps.
The caches are NOT filled by prefill (a 32K prefill of the whole batch would dominate the run):
random rows are written straight into every layer's SWA ring (all ring slots of each state
slot) and compressor / indexer pools (entries ``j < context // r`` at the block-table slots)
with ``PagedRows.store`` (= ``store_kv_cache``), and the family's per-request bookkeeping is
set to ``context`` so the first planned step continues there. Only decode steps are timed
(plan + forward + argmax, synchronised; the logits in the model dtype and the argmax
captured in the decode graph, or `kvplan.ops.argmax.argmax_rows` after eager steps and with
``KVPLAN_GRAPH_ARGMAX=0``, as the engine runs them).

Reported per (kv_format, context): decode step time (median), the host planning time, and the
step's floor = (weight bytes + bytes of KV rows, index keys and compressed entries the step
reads) / device copy bandwidth (2N bytes moved by an N-byte device copy, measured here);
KV bytes per token of context (fp4 and fp8 records, bf16 "exact" rows vs a dense bf16 K=V
cache of the same model: layers x head_dim x 2 bytes); the largest batch whose caches fit at
32K / 128K.
Weight bytes count every expert (a batch of 32 touches nearly all 16) and only the batch's
embedding rows. No Hugging Face comparison is run (its model at these shapes is slow).

GPU:  PYTHONPATH=. python3 bench/bench_hybrid.py --out results.json     (< 4 min on an H200)
CPU:  PYTHONPATH=. python3 bench/bench_hybrid.py --quick --out q.json  (tiny model, < 1 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported

from kvplan.backends.hybrid.api import HybridSeq  # noqa: E402
from kvplan.backends.hybrid.planned import PlannedHybridFamily  # noqa: E402
from kvplan.backends.hybrid.storage import index_format, main_format  # noqa: E402
from kvplan.engine.hybrid import HybridCausalLM  # noqa: E402
from kvplan.engine.hybrid_graphs import HybridDecodeGraphs  # noqa: E402
from kvplan.engine.request import TokenIds  # noqa: E402
from kvplan.models.deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    cast_model,
    init_random,
)
from kvplan.ops import hyper_connection as hcm  # noqa: E402
from kvplan.ops.argmax import argmax_rows  # noqa: E402
from kvplan.plan.compressor_state import state_rows  # noqa: E402

GiB = 1 << 30


def model_shape(quick: bool) -> dict:
    """The model's Hugging Face ``DeepseekV4Config`` arguments (layer types: HF's default
    order); `bench/bench_hybrid_hf.py` builds the same model from them."""
    if quick:
        d = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                 head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                 sliding_window=8, compress_rates={"compressed_sparse_attention": 4,
                 "heavily_compressed_attention": 16}, index_topk=8, index_n_heads=4,
                 index_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, hc_mult=2, hc_sinkhorn_iters=3, num_hash_layers=1)  # fmt: skip
    else:
        d = dict(vocab_size=129280, hidden_size=2048, num_hidden_layers=12,
                 num_attention_heads=16, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512,
                 o_groups=8, o_lora_rank=512, sliding_window=128,
                 compress_rates={"compressed_sparse_attention": 4,
                                 "heavily_compressed_attention": 128},
                 index_topk=512, index_n_heads=32, index_head_dim=128, n_routed_experts=16,
                 num_experts_per_tok=2, moe_intermediate_size=1024, hc_mult=4,
                 hc_sinkhorn_iters=20)  # fmt: skip
    return d


def model_config(quick: bool) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf({"model_type": "deepseek_v4", **model_shape(quick)})


# ---- bytes -------------------------------------------------------------------------------


def bench_model(cfg: DeepseekV4Config, dev: torch.device, dtype: torch.dtype):
    """The random-weight benchmark model on ``dev`` in ``dtype``, in eval mode, its logits in
    the model dtype (as the engine runs it, eager steps too)."""
    torch.manual_seed(0)
    with torch.device(dev):
        model = DeepseekV4ForCausalLM(cfg)
    model = init_random(model, seed=0)
    if dtype != torch.float32:
        model = cast_model(model, dtype)
    model.eval()
    model.float_logits = False
    return model


def layout_bytes(kv_format: str, spec, dtype: torch.dtype) -> tuple[int, int]:
    """(main row bytes, index key bytes) per entry for one layer."""
    main = main_format(kv_format, spec.head_dim, dtype).bytes_per_token
    if not spec.overlap:
        return main, 0
    return main, index_format(kv_format, None, spec.index_head_dim, dtype).bytes_per_token


def bytes_per_token(cfg: DeepseekV4Config, kv_format: str, dtype: torch.dtype) -> float:
    """Cache bytes per token of context (all layers; compressed entries amortised)."""
    total = 0.0
    for spec in cfg.layer_specs():
        if spec.kind == "sliding_attention":
            continue
        main, index = layout_bytes(kv_format, spec, dtype)
        total += (main + index) / spec.ratio
    return total


def state_bytes_per_seq(cfg: DeepseekV4Config, kv_format: str, dtype: torch.dtype) -> int:
    """Per-sequence bytes that do not grow with context: SWA ring, fp32 compressor state."""
    total = 0
    for spec in cfg.layer_specs():
        main, _ = layout_bytes(kv_format, spec, dtype)
        total += spec.window * main
        if spec.kind == "sliding_attention":
            continue
        k = 2 if spec.overlap else 1
        for name in ("compressor", "indexer")[:k]:
            total += 2 * 4 * state_rows(spec.ratio, spec.overlap) * k * spec.series_width(name)
    return total


def step_read_bytes(cfg, kv_format, dtype, batch: int, context: int) -> int:
    """KV rows, index keys and compressed entries one decode step reads."""
    total = 0
    for spec in cfg.layer_specs():
        main, index = layout_bytes(kv_format, spec, dtype)
        total += min(context + 1, spec.window) * main
        if spec.kind == "sliding_attention":
            continue
        entries = (context + 1) // spec.ratio
        total += (
            (min(spec.top_k, entries) * main + entries * index)
            if spec.overlap
            else (entries * main)
        )
    return batch * total


def weight_bytes(model: DeepseekV4ForCausalLM, batch: int) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    return total - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device copy (read + write) of a 1 GiB buffer (CPU: 64 MiB)."""
    n = GiB if device.type == "cuda" else 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / min(times[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- one decode run ------------------------------------------------------------------------


def fill_caches(family: PlannedHybridFamily, seqs: list[HybridSeq], context: int, gen) -> None:
    """Random rows in every ring slot and every closed compressed entry (module docstring)."""
    dev, dtype = family.device, family.dtype
    tables = torch.tensor([list(s.block_table) for s in seqs], dtype=torch.int64, device=dev)
    for spec, caches in zip(family.layers, family.caches):
        ring = caches.ring
        n = ring.cache.shape[0] * ring.block_size
        slots = torch.arange(n, dtype=torch.int32, device=dev)
        ring.store(torch.randn(n, spec.head_dim, generator=gen, device=dev, dtype=dtype), slots)
        for pool in caches.pools.values():
            num = context // spec.ratio
            if num == 0:
                continue
            tpb = pool.block_size
            j = torch.arange(num, device=dev)
            all_slots = (tables[:, j // tpb] * tpb + j % tpb).reshape(-1).to(torch.int32)
            for lo in range(0, all_slots.numel(), 1 << 18):
                part = all_slots[lo : lo + (1 << 18)]
                rows = torch.randn(part.numel(), pool.width, generator=gen, device=dev, dtype=dtype)
                pool.store(rows, part)
    # the caches hold `context` tokens without a planned prefill: record them as one step
    family.record([dataclasses.replace(s, q_start=0, seqlen_q=context) for s in seqs])


def run_decode(
    model,
    cfg,
    kv_format,
    dtype,
    batch,
    context,
    steps,
    warmup,
    block_size,
    gen,
    graphs=False,
    profile=0,
    max_model_len=0,
    context_bounds=None,
):
    """Fill the caches at ``context`` and time ``steps`` decode steps after ``warmup``.

    ``graphs``: the steps replay a captured CUDA graph of the batch
    (`kvplan.engine.hybrid_graphs.HybridDecodeGraphs`, one bucket of ``batch`` rows); the host
    half (``stage``: checks, the packed decode facts, the upload) is timed as "plan".
    ``profile``: profile that many extra steps and return the top kernels by device time.
    ``max_model_len``: the family's bound when larger than the run needs (a server's
    ``max_model_len`` above the contexts it serves). ``context_bounds``: the graphs' shorter
    context tiers (None: their default; ``()``: one graph for ``max_model_len``).
    """
    dev = model.embed_tokens.weight.device
    max_len = context + warmup + 2 * steps + profile + 1
    blocks_per_seq = -(-max_len // block_size)
    family = PlannedHybridFamily(
        cfg.layer_specs(), block_size=block_size, num_blocks=batch * blocks_per_seq + 1,
        num_state_slots=batch, max_model_len=max(max_len, max_model_len), kv_format=kv_format,
        dtype=dtype,
        device=dev,
    )  # fmt: skip
    perm = torch.randperm(batch * blocks_per_seq, generator=torch.Generator().manual_seed(0)) + 1
    # int32 numpy rows, as the engine hands the family (KVCacheManager.get_block_ids_view)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).numpy()
    token_ids = TokenIds([0] * max_len, [])  # O(1) prefix slices, as the engine's token_view
    seqs = [HybridSeq(b, context, 1, token_ids, tables[b], b) for b in range(batch)]
    fill_caches(family, seqs, context, gen)
    runner = None
    if graphs:
        runner = HybridDecodeGraphs(HybridCausalLM(model), family, batch, context_bounds)
        runner.buckets = [batch]
        runner.steps = {k: v for k, v in runner.steps.items() if k[0] == batch}
        runner.capture_all()
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=dev)

    def one_step(q_start: int) -> tuple[torch.Tensor, float]:
        seqs = [HybridSeq(b, q_start, 1, token_ids, tables[b], b) for b in range(batch)]
        t0 = time.perf_counter()
        if runner is not None:
            runner.stage(seqs)
            t1 = time.perf_counter()
            out = runner.run(SimpleNamespace(input_ids=ids), device_input_ids=ids)
            tokens = runner.greedy_tokens(batch)  # the graph's own argmax, as the engine's
            if tokens is not None:
                return tokens, t1 - t0
        else:
            positions = torch.full((batch,), q_start, dtype=torch.int64, device=dev)
            ctx = family.plan(seqs, positions)
            t1 = time.perf_counter()
            with torch.no_grad():
                out = model(ids, positions, ctx)
        return argmax_rows(out), t1 - t0

    plan_s, step_s = [], []
    for step in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        ids, plan_t = one_step(context + step)
        sync(dev)
        t2 = time.perf_counter()
        if step >= warmup:
            plan_s.append(plan_t)
            step_s.append(t2 - t0)
    out = {}
    if runner is not None:  # the engine's async scheduling: step i + 1 staged during step i
        out["pipelined_ms"] = pipelined_steps(runner, batch, token_ids, tables, ids,
                                              context + warmup + steps, steps, dev) * 1e3  # fmt: skip
    if profile:  # positions continue where the last run stopped (the caches' state)
        done = context + warmup + (2 * steps if runner is not None else steps)
        out["profile"], out["timeline"] = profile_steps(lambda i: one_step(done + i), profile,
                                                        dev)  # fmt: skip
    cache_bytes = sum(p.cache.numel() for c in family.caches for p in [c.ring, *c.pools.values()])
    if runner is not None:
        out["max_model_len"] = family.config.max_model_len
        out["graph_tiers"] = runner.tiers
        out["tier_replays"] = runner.tier_replays
    return {
        "mode": "graphs" if graphs else "eager",
        "step_ms": statistics.median(step_s) * 1e3,
        "plan_ms": statistics.median(plan_s) * 1e3,
        "host_share": statistics.median(p / s for p, s in zip(plan_s, step_s)),
        "cache_bytes": cache_bytes,
        **out,
    }


def pipelined_steps(runner, batch, token_ids, tables, ids, q_start, steps, dev) -> float:
    """Seconds per decode step when each step is staged and launched while the previous one
    runs, fed by its device tokens (``stage(ahead=True)``), and the host waits for step i's
    tokens only after launching step i + 1: the engine's async scheduling."""
    sync(dev)
    t0 = time.perf_counter()
    pending = None
    for i in range(steps):
        seqs = [HybridSeq(b, q_start + i, 1, token_ids, tables[b], b) for b in range(batch)]
        runner.stage(seqs, ahead=True)
        logits = runner.run(SimpleNamespace(input_ids=ids), device_input_ids=ids)
        tokens = runner.greedy_tokens(batch)  # the next run copies them before its replay
        ids = argmax_rows(logits) if tokens is None else tokens
        done = torch.cuda.Event() if dev.type == "cuda" else None
        if done is not None:
            done.record()
        if pending is not None:
            pending.synchronize()
        pending = done
    sync(dev)
    return (time.perf_counter() - t0) / steps


def profile_steps(step_fn, n: int, dev: torch.device, top: int = 30) -> tuple[list, list]:
    """Run ``n`` steps under the torch profiler: the ``top`` kernels / ops by device time
    (total over the steps, divided by ``n``: per step), and the last step's device kernels in
    start order as ``[name, start_us, duration_us]`` (start from the first of those kernels;
    the gaps between them are the device's idle time inside the step)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            step_fn(i)
        sync(dev)
    attr = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    rows = [{  # every device kernel of the step: its count and summed time
        "name": "ALL KERNELS",
        "us_per_step": sum(getattr(e, attr, 0) for e in kernels) / n,
        "calls_per_step": sum(e.count for e in kernels) / n,
    }] if kernels else []  # fmt: skip
    for e in events[:top]:
        rows.append({
            "name": e.key[:120],
            "us_per_step": getattr(e, attr, 0) / n,
            "calls_per_step": e.count / n,
        })  # fmt: skip
    timed = sorted((e.time_range.start, e.time_range.elapsed_us(), e.name)
                   for e in prof.events() if e.device_type == DeviceType.CUDA)  # fmt: skip
    per_step = len(timed) // n if n else 0
    last = timed[len(timed) - per_step :] if per_step else []
    t0 = last[0][0] if last else 0
    timeline = [[name[:80], round(start - t0, 2), round(dur, 2)] for start, dur, name in last]
    return rows, timeline


def kernel_bench(dev: torch.device, batch: int) -> list[dict]:
    """Decode attention of one CSA layer alone (``batch`` rows, 16 heads, 128 ring + 512
    chosen V41 FP8 rows): ``sparse_attention`` reading the caches in place (a few tile
    configs, each checked against the gathered path) vs gathering with ``load_slots`` and
    attending with the dense torch ``sink_attention``."""
    from kvplan.backends.hybrid.sparse_attention import sink_attention
    from kvplan.backends.hybrid.storage import PagedRows
    from kvplan.formats import V41_FORMAT
    from kvplan.ops.sparse_attention import sparse_attention_triton

    gen = torch.Generator(device=dev).manual_seed(2)
    ring = PagedRows(batch, 128, V41_FORMAT, 512, device=dev)
    pool = PagedRows(batch * 64, 64, V41_FORMAT, 512, device=dev)
    for rows in (ring, pool):
        n = rows.cache.shape[0] * rows.block_size
        slots = torch.arange(n, dtype=torch.int32, device=dev)
        rows.store(torch.randn(n, 512, generator=gen, device=dev), slots)
    idx0 = torch.arange(batch * 128, dtype=torch.int32, device=dev).view(batch, 128)
    idx1 = torch.randint(0, batch * 64 * 64, (batch, 512), generator=gen, device=dev)
    idx1 = idx1.to(torch.int32)
    q = torch.randn(batch, 16, 512, generator=gen, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(16, generator=gen, device=dev)
    sources = [ring.key_source(idx0), pool.key_source(idx1)]
    joined = torch.arange(batch * 640, dtype=torch.int32, device=dev)
    index = torch.cat([joined[: batch * 128].view(batch, 128),
                       joined[batch * 128 :].view(batch, 512)], dim=1)  # fmt: skip

    def gathered():
        rows = torch.cat([ring.load_slots(idx0), pool.load_slots(idx1)])
        return sink_attention(q, rows, index, sinks, 512**-0.5)

    want = gathered().float()
    out = [{"path": "gather + torch", "ms": timed(gathered, dev) * 1e3}]
    for tile_n, warps in ((16, 4), (16, 8), (32, 8), (64, 8)):

        def fn(tile_n=tile_n, warps=warps):
            return sparse_attention_triton(q, sources, sinks, 512**-0.5, check=False,
                                           tile_n=tile_n, num_warps=warps)  # fmt: skip

        err = float((fn().float() - want).abs().max())
        out.append({"path": f"in place tile_n={tile_n} warps={warps}",
                    "ms": timed(fn, dev) * 1e3, "max_abs_err": err})  # fmt: skip
    return out


def timed(fn, dev: torch.device, reps: int = 20) -> float:
    """Median seconds per call (2 warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- main --------------------------------------------------------------------------------


KV_FORMATS = ("fp4", "fp8", "exact")  # the family's formats, in the bytes and capacity tables


def capacity(cfg, dtype, weights: int, total_mem: int, reserve: int, context: int) -> dict:
    """Largest batch whose caches fit in ``total_mem - weights - reserve`` at ``context``."""
    budget = total_mem - weights - reserve
    out = {}
    for name in KV_FORMATS:
        per_seq = context * bytes_per_token(cfg, name, dtype) + state_bytes_per_seq(
            cfg, name, dtype
        )
        out[name] = int(budget // per_seq)
    out["dense_bf16"] = int(budget // (context * cfg.num_layers * cfg.head_dim * 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--contexts", default=None, help="comma-separated, e.g. 4096,32768")
    ap.add_argument("--formats", default="fp8,exact")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated eager,graphs (default: graphs on CUDA, eager on CPU)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS extra steps of each run: top kernels in the JSON",
    )
    ap.add_argument("--time-budget", type=float, default=180.0, help="seconds; later runs skip")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the family's max_model_len when larger than a run needs (default: "
                    "the context plus the run's steps)")  # fmt: skip
    ap.add_argument("--no-tiers", action="store_true",
                    help="graphs: one per batch for max_model_len, no shorter context tiers")  # fmt: skip
    ap.add_argument("--hc-fused-max-rows", default=None,
                    help="comma-separated values of kvplan.ops.hyper_connection.FUSED_MAX_ROWS "
                    "to run each format / context under (A/B of the fused residual update)")  # fmt: skip
    args = ap.parse_args()
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = model_config(args.quick)
    batch = args.batch or (32 if cuda else 2)
    contexts = [
        int(c) for c in (args.contexts or ("4096,32768,131072" if cuda else "64,256")).split(",")
    ]
    steps, warmup = (args.steps or (5 if cuda else 2)), (2 if cuda else 1)
    block_size = 256 if cuda else 32
    model = bench_model(cfg, dev, dtype)
    bw = copy_bandwidth(dev)
    weights = weight_bytes(model, batch)
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    modes = (args.modes or ("graphs" if cuda else "eager")).split(",")
    fused = [None] if args.hc_fused_max_rows is None else args.hc_fused_max_rows.split(",")
    runs = [(f, c, m, h) for f in args.formats.split(",") for c in contexts for m in modes
            for h in fused]  # fmt: skip
    for kv_format, context, mode, hc_rows in runs:
        row = {"kv_format": kv_format, "context": context, "batch": batch, "mode": mode}
        if hc_rows is not None:
            hcm.FUSED_MAX_ROWS = row["hc_fused_max_rows"] = int(hc_rows)
        if time.perf_counter() - start > args.time_budget:
            row["skipped"] = "time budget"
            rows.append(row)
            continue
        try:
            row.update(run_decode(model, cfg, kv_format, dtype, batch, context, steps, warmup,
                                  block_size, gen, graphs=mode == "graphs",
                                  profile=args.profile,
                                  max_model_len=args.max_model_len,
                                  context_bounds=() if args.no_tiers else None))  # fmt: skip
        except torch.OutOfMemoryError:
            row["skipped"] = "out of memory"
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        kv = step_read_bytes(cfg, kv_format, dtype, batch, context)
        row["read_bytes"] = {"weights": weights, "kv": kv}
        row["floor_ms"] = (weights + kv) / bw * 1e3
        row["vs_floor"] = row["step_ms"] / row["floor_ms"]
        if "pipelined_ms" in row:
            row["pipelined_vs_floor"] = row["pipelined_ms"] / row["floor_ms"]
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    kernels = kernel_bench(dev, batch) if cuda else []
    total_mem = torch.cuda.get_device_properties(dev).total_memory if cuda else 8 * GiB
    reserve = 8 * GiB if cuda else GiB // 4
    per_token = {f: bytes_per_token(cfg, f, dtype) for f in KV_FORMATS}
    per_token["dense_bf16"] = cfg.num_layers * cfg.head_dim * 2
    caps = {str(c): capacity(cfg, dtype, weights, total_mem, reserve, c) for c in (32768, 131072)}
    record = {
        "bench": "hybrid",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "model": {
            "params": sum(p.numel() for p in model.parameters()),
            "layers": cfg.num_layers,
            "layer_types": list(cfg.layer_types),
            "hidden": cfg.hidden_size,
            "heads": cfg.num_heads,
            "head_dim": cfg.head_dim,
            "experts": cfg.n_routed_experts,
            "dtype": str(dtype),
        },  # fmt: skip
        "copy_bandwidth_GBps": bw / 1e9,
        "decode": rows,
        "kernel_decode_attention": kernels,
        "kv_bytes_per_token": per_token,
        "state_bytes_per_seq": {f: state_bytes_per_seq(cfg, f, dtype) for f in KV_FORMATS},
        "max_batch": {"total_mem": total_mem, "reserve": reserve, "weights": weights, **caps},
        "seconds": time.perf_counter() - start,
    }
    print(f"{record['device']}  params {record['model']['params'] / 1e9:.2f}B  "
          f"copy {bw / 1e9:.0f} GB/s  weights {weights / 1e9:.2f} GB")  # fmt: skip
    print(f"{'format':>6} {'context':>8} {'batch':>5} {'mode':>6} {'step ms':>9} {'host ms':>8} "
          f"{'floor ms':>9} {'x floor':>8}")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(
                f"{r['kv_format']:>6} {r['context']:>8} {r['batch']:>5} {r['mode']:>6}  "
                f"skipped: {r['skipped']}"
            )
            continue
        print(f"{r['kv_format']:>6} {r['context']:>8} {r['batch']:>5} {r['mode']:>6} "
              f"{r['step_ms']:9.2f} {r['plan_ms']:8.2f} {r['floor_ms']:9.3f} "
              f"{r['vs_floor']:8.1f}"
              + (f"  hc fused <= {r['hc_fused_max_rows']} rows" if "hc_fused_max_rows" in r
                 else ""))  # fmt: skip
        if "pipelined_ms" in r:
            print(f"{'':>6} {'':>8} {'':>5} {'async':>6} {r['pipelined_ms']:9.2f} {'':>8} "
                  f"{'':>9} {r['pipelined_vs_floor']:8.1f}")  # fmt: skip
        for k in r.get("profile", [])[:31]:
            print(f"    {k['us_per_step']:10.1f} us  x{k['calls_per_step']:6.1f}  {k['name']}")
    for k in kernels:
        print(
            f"one CSA layer decode attention, {k['path']}: {k['ms']:.3f} ms"
            + (f" (max err {k['max_abs_err']:.1e})" if "max_abs_err" in k else "")
        )
    dense = per_token["dense_bf16"]
    for f in KV_FORMATS:
        print(
            f"KV bytes/token {f}: {per_token[f]:.1f} (dense bf16 {dense}: {dense / per_token[f]:.1f}x)"
        )
    for c, cap in caps.items():
        print(f"max batch at {c}: " + ", ".join(f"{k} {v}" for k, v in cap.items()))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    print(f"done in {record['seconds']:.1f}s")


if __name__ == "__main__":
    main()
