"""DeepSeek-V4 block pieces: one hyper-connection (pre + post) and one MoE block, torch path vs
kvplan's fused path, at a decode-sized batch.

Shapes (GPU mode): hidden 2048, hc_mult 4, 20 Sinkhorn iterations, 16 experts top-2 of width
1024 plus the shared expert, T = 32 rows, bf16 activations and weights (hyper-connection
weights fp32), random values.

* ``hc``: ``post, comb, x = pre(s)`` then ``s' = post(s, post, comb, out)``; torch =
  `hc_pre_torch` + `hc_post_torch` (the reference), new = `hc_pre` + `hc_post` (Triton);
* ``moe``: the router, the routed experts and the shared expert; torch = the torch router,
  the per-expert loop (`experts_dense_loop`) and the torch SwiGLU (the former dense path),
  new = `DeepseekV4MoE.forward` on its batched dense path (`graph_safe_routing`);
* ``rms_norm``: the weighted RMSNorm of one ``[T, hidden]`` row block;
* ``hc_post_pre@R`` (R in ``--hc-rows``, default 32 and 4096): a residual update followed by
  the next connection; unfused = `hc_post` + `hc_pre` (Triton, three kernels), fused =
  `hc_post_pre` (two kernels); their outputs must be equal (max|diff| 0).
* ``hc_pre@R`` (R above ``TC_MIN_ROWS``): the projection's IEEE fp32 form against its
  tensor-core form (bf16 rows; max|diff| is fp32 rounding).
* ``hc_pre_rows@R`` / ``hc_post_rows@R`` (R above ``ROW_TILED_MIN_ROWS``): the one-token
  epilogue kernels (``one-tok``) against the row-tiled ones (``rows``), then a line per piece
  naming the faster; max|diff| must be 0. ``--hc-sweep`` times the row-tiled kernels over a
  few row tiles at the largest R.

``--sweep`` also times `hc_pre` (Triton) at ``--rows`` over a few launch plans of the
projection (row tile, hidden columns per tile, programs wanted, warps) and epilogue warps.

Reported per piece and path: median time per call (CUDA events) run eagerly and replayed as a
CUDA graph, kernels per call (torch.profiler, CUDA kernels and memsets), and the largest
absolute difference between the two paths' outputs.

GPU:  PYTHONPATH=. python3 bench/bench_dsv4_blocks.py --out blocks.json
CPU:  PYTHONPATH=. python3 bench/bench_dsv4_blocks.py --quick   (tiny shapes, Triton interpreter)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported
    os.environ["KVPLAN_FORCE_TRITON"] = "1"  # the "new" path runs its kernels interpreted

import torch.nn.functional as F  # noqa: E402

from kvplan.models.deepseek_v4 import DeepseekV4Config  # noqa: E402
from kvplan.models.deepseek_v4.hyper import HyperConnection  # noqa: E402
from kvplan.models.deepseek_v4.moe import DeepseekV4MoE, graph_safe_routing  # noqa: E402
from kvplan.ops import hyper_connection as hcm  # noqa: E402
from kvplan.ops import moe_grouped as mg  # noqa: E402
from kvplan.ops.cache_geometry import triton_next_pow2  # noqa: E402
from kvplan.ops.hyper_connection import (  # noqa: E402
    hc_post,
    hc_post_pre,
    hc_post_torch,
    hc_pre,
    hc_pre_torch,
)
from kvplan.ops.moe_dense import moe_route_torch, swiglu_torch  # noqa: E402
from kvplan.ops.rms_norm import rms_norm_fp32w, rms_norm_fp32w_torch  # noqa: E402


def config(quick: bool) -> DeepseekV4Config:
    if quick:
        d = dict(vocab_size=128, hidden_size=64, n_routed_experts=4, moe_intermediate_size=32,
                 hc_mult=2, hc_sinkhorn_iters=3)  # fmt: skip
    else:
        d = dict(vocab_size=129280, hidden_size=2048, n_routed_experts=16,
                 moe_intermediate_size=1024, hc_mult=4, hc_sinkhorn_iters=20)  # fmt: skip
    d.update(num_hidden_layers=2, num_experts_per_tok=2, num_hash_layers=0,
             mlp_layer_types=["moe", "moe"])  # fmt: skip
    return DeepseekV4Config.from_hf({"model_type": "deepseek_v4", **d})


@torch.no_grad()
def build(cfg: DeepseekV4Config, rows: int, dev: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, std=1.0, dt=dtype):
        return (torch.randn(shape, generator=gen, device=dev) * std).to(dt)

    h, n = cfg.hidden_size, cfg.hc_mult
    with torch.device(dev):
        hc = HyperConnection(h, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        moe = DeepseekV4MoE(cfg, 0)
    hc.fn.copy_(rnd(*hc.fn.shape, std=0.02, dt=torch.float32))
    hc.base.copy_(rnd(*hc.base.shape, std=0.1, dt=torch.float32))
    hc.scale.copy_(1 + rnd(3, std=0.1, dt=torch.float32))
    for p in moe.parameters():
        p.data = rnd(*p.shape, std=0.02)
    moe.e_score_correction_bias.copy_(rnd(cfg.n_routed_experts, std=0.1, dt=torch.float32))
    data = dict(
        s=rnd(rows, n, h), out=rnd(rows, h), x=rnd(rows, h),
        ids=torch.randint(0, cfg.vocab_size, (rows,), generator=gen, device=dev),
        norm=1 + rnd(h, std=0.1, dt=torch.float32),
    )  # fmt: skip
    return hc, moe, data


def hc_fns(hc: HyperConnection, d: dict):
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)

    def torch_path():
        post, comb, x = hc_pre_torch(d["s"], hc.fn, hc.base, hc.scale, **kw)
        return hc_post_torch(d["s"], post, comb, d["out"]), x

    def new_path():
        post, comb, x = hc_pre(d["s"], hc.fn, hc.base, hc.scale, **kw)
        return hc_post(d["s"], post, comb, d["out"]), x

    return torch_path, new_path


def projection_form_fns(hc: HyperConnection, rows: int, dev: torch.device):
    """(IEEE fp32 dots, tensor-core form) of `hc_pre` on ``rows`` random bf16 rows: the
    projection's two forms (``TC_MIN_ROWS`` moved so ``rows`` takes one or the other)."""
    gen = torch.Generator(device=dev).manual_seed(rows + 1)
    n, h = hc.n, hc.fn.shape[1] // hc.n
    s = torch.randn(rows, n, h, generator=gen, device=dev).to(torch.bfloat16)
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)

    def run(threshold: int):
        def fn():
            saved, hcm.TC_MIN_ROWS = hcm.TC_MIN_ROWS, threshold
            try:
                return hc_pre(s, hc.fn, hc.base, hc.scale, **kw)
            finally:
                hcm.TC_MIN_ROWS = saved

        return fn

    return run(rows), run(0)


def row_tiled_fns(hc: HyperConnection, rows: int, dev: torch.device, op: str, tiles=None):
    """(one-token kernels, row-tiled kernels) of `hc_pre`'s epilogue (``op="pre"``, the whole
    `hc_pre`) or `hc_post` (``op="post"``) on ``rows`` random bf16 rows; ``tiles`` (a
    ``RowTile``) replaces the op's default row tile for the row-tiled side."""
    gen = torch.Generator(device=dev).manual_seed(rows + 2)
    n, h = hc.n, hc.fn.shape[1] // hc.n
    s = torch.randn(rows, n, h, generator=gen, device=dev).to(torch.bfloat16)
    out = torch.randn(rows, h, generator=gen, device=dev).to(torch.bfloat16)
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)
    post, comb, _ = hc_pre_torch(s, hc.fn, hc.base, hc.scale, **kw)
    name = "PRE_ROW_TILE" if op == "pre" else "POST_ROW_TILE"
    limit = "PRE_ROW_TILED_MIN_ROWS" if op == "pre" else "ROW_TILED_MIN_ROWS"

    def run(min_rows: int):
        def fn():
            saved = getattr(hcm, limit), getattr(hcm, name)
            setattr(hcm, limit, min_rows)
            setattr(hcm, name, tiles or saved[1])
            try:
                if op == "pre":
                    return hc_pre(s, hc.fn, hc.base, hc.scale, **kw)
                return (hc_post(s, post, comb, out),)
            finally:
                setattr(hcm, limit, saved[0])
                setattr(hcm, name, saved[1])

        return fn

    return run(rows), run(0)


def sweep_row_tiles(hc: HyperConnection, rows: int, dev: torch.device, iters: int) -> list[dict]:
    """Graph time of the row-tiled `hc_pre` / `hc_post` per (tile_t, tile_h, warps)."""
    res = []
    for op in ("pre", "post"):
        for tt in (2, 4, 8, 16):
            for th in (256, 512, 1024):
                for w in (4, 8):
                    fn = row_tiled_fns(hc, rows, dev, op, hcm.RowTile(tt, th, w))[1]
                    fn()
                    res.append(dict(op=op, tile=f"{tt}x{th}x{w}",
                                    graph_us=time_cuda(fn, iters, graph=True)))  # fmt: skip
    return sorted(res, key=lambda r: (r["op"], r["graph_us"]))


def post_pre_fns(
    hc: HyperConnection, rows: int, dev: torch.device, dtype: torch.dtype, norm: bool = False
):
    """(unfused, fused) residual update + next connection on ``rows`` random rows (``norm``:
    with the block's RMSNorm, as the model calls it)."""
    gen = torch.Generator(device=dev).manual_seed(rows)
    n, h = hc.n, hc.fn.shape[1] // hc.n
    s = torch.randn(rows, n, h, generator=gen, device=dev).to(dtype)
    out = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)
    post, comb, _ = hc_pre_torch(s, hc.fn, hc.base, hc.scale, **kw)

    if norm:  # the model's call: the block input through the block's RMSNorm
        kw["norm"] = (torch.rand(h, generator=gen, device=dev) + 0.5, hc.eps)

    def unfused():
        s2 = hc_post(s, post, comb, out)
        return (s2, *hc_pre(s2, hc.fn, hc.base, hc.scale, **kw))

    def fused():
        return hc_post_pre(s, post, comb, out, hc.fn, hc.base, hc.scale, **kw)

    return unfused, fused


def sweep_plans(hc: HyperConnection, d: dict, iters: int) -> list[dict]:
    """`hc_pre` (Triton) per launch plan: (tile_t, tile_h, programs wanted, proj warps,
    epilogue warps, tensor-core dots); the kvplan default first. Prefill sizes (``T > 256``)
    sweep larger row tiles and the tensor-core form (bf16 streams) instead of the 1-2 warp
    epilogues."""
    t, n, h = d["s"].shape
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)
    default_plan, default_warps = hcm._proj_plan, hcm._epilogue_warps
    big = t > 256
    bf16 = d["s"].dtype == torch.bfloat16
    variants = [None] + [
        (tt, th, target, pw, ew, tc)
        for tt in ((32, 64, 128) if big else (16, 32))
        for th in (8, 16, 32, 64)
        for target in ((128, 256, 512) if big else (32, 64, 128, 256))
        for pw in ((4, 8) if big else (2, 4))
        for ew in ((4,) if big else (1, 2, 4))
        for tc in ((False, True) if big and bf16 else (False,))
        if tt <= max(16, triton_next_pow2(t)) and 16 <= th * triton_next_pow2(n) <= 256
    ]
    if bf16 and not big:  # decode sizes: the tensor-core form (the default since session 14)
        variants = [None] + [
            (tt, th, target, pw, 1, True)
            for tt in (16, 32)
            for th in (4, 8, 16, 32)
            for target in (128, 256, 512)
            for pw in (4,)
            if tt <= max(16, triton_next_pow2(t)) and 16 <= th * triton_next_pow2(n) <= 256
        ]
    fused = t <= hcm.FUSED_MAX_ROWS
    if fused:
        d["post"], d["comb"], _ = hc_pre_torch(d["s"], hc.fn, hc.base, hc.scale, **kw)
    rows = []
    try:
        for v in variants:
            if v is not None:
                tt, th, target, pw, ew, tc = v
                h_tiles = -(-h // th)
                splits = max(1, min(h_tiles, target // -(-t // tt)))
                hps = -(-h_tiles // splits) * th
                plan = hcm._ProjPlan(tt, th, hps, -(-h // hps), pw, tc)
                hcm._proj_plan = lambda *_a, plan=plan: plan
                hcm._epilogue_warps = lambda *_a, ew=ew: ew
            fn = lambda: hc_pre(d["s"], hc.fn, hc.base, hc.scale, **kw)  # noqa: E731
            fn()
            cur = hcm._proj_plan(t, n, h, d["s"].dtype)
            row = dict(plan="default" if v is None else "x".join(map(str, v)),
                       splits=cur.splits, graph_us=time_cuda(fn, iters, graph=True))  # fmt: skip
            if fused:  # the decode steps' form: the residual update fused in (hc_post_pre)
                fused_fn = lambda: hc_post_pre(d["s"], d["post"], d["comb"], d["out"], hc.fn,  # noqa: E731
                                               hc.base, hc.scale, **kw)  # fmt: skip
                fused_fn()
                row["post_pre_graph_us"] = time_cuda(fused_fn, iters, graph=True)
            rows.append(row)
    finally:
        hcm._proj_plan, hcm._epilogue_warps = default_plan, default_warps
    return sorted(rows, key=lambda r: r.get("post_pre_graph_us", r["graph_us"]))


def sweep_proj_programs(hc: HyperConnection, d: dict, iters: int, programs: list[int]):
    """`hc_pre` at ``d``'s rows with the projection's program target
    (`hyper_connection.PROJ_PROGRAMS`) set to each of ``programs``: graph-replay microseconds
    and the splits each gives."""
    t, n, h = d["s"].shape
    kw = dict(iters=hc.iters, hc_eps=hc.hc_eps, eps=hc.eps)
    saved = hcm.PROJ_PROGRAMS
    rows = []
    try:
        for target in programs:
            hcm.PROJ_PROGRAMS = (saved[0], target) if t > 256 else (target, saved[1])
            fn = lambda: hc_pre(d["s"], hc.fn, hc.base, hc.scale, **kw)  # noqa: E731
            fn()
            splits = hcm._proj_plan(t, n, h, d["s"].dtype).splits
            rows.append(dict(programs=target, splits=splits,
                             graph_us=time_cuda(fn, iters, graph=True)))  # fmt: skip
    finally:
        hcm.PROJ_PROGRAMS = saved
    return rows


def moe_fns(moe: DeepseekV4MoE, d: dict):
    x, ids = d["x"], d["ids"]
    sh = moe.shared

    def torch_path():
        logits = F.linear(x, moe.gate_weight)
        r_ids, r_w, _ = moe_route_torch(
            logits, top_k=moe.top_k, sigmoid=moe.scoring_func == "sigmoid",
            scaling=moe.scaling, bias=moe.e_score_correction_bias,
        )  # fmt: skip
        shared = sh.down_proj(swiglu_torch(sh.gate_proj(x), sh.up_proj(x), sh.limit))
        return (moe.experts_dense_loop(x, r_ids, r_w) + shared,)

    def new_path():
        with graph_safe_routing(moe):
            return (moe(x, ids),)

    return torch_path, new_path


def norm_fns(d: dict, eps: float):
    return (lambda: (rms_norm_fp32w_torch(d["x"], d["norm"], eps),),
            lambda: (rms_norm_fp32w(d["x"], d["norm"], eps),))  # fmt: skip


def moe_sweep_inputs(cfg: DeepseekV4Config, rows: int, dev: torch.device):
    """(x bf16 ``[rows, hidden]``, ids, weights, gate_up, down) with router-picked
    experts (random router, correction bias) for the grouped MoE sweep."""
    gen = torch.Generator(device=dev).manual_seed(rows)
    e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def rnd(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device=dev) * std).to(torch.bfloat16)

    x = rnd(rows, h)
    logits = F.linear(x, rnd(e, h, std=0.02))
    bias = torch.randn(e, generator=gen, device=dev) * 0.1
    ids, w, _ = moe_route_torch(logits, top_k=cfg.num_experts_per_tok, sigmoid=True,
                                scaling=cfg.routed_scaling_factor, bias=bias)  # fmt: skip
    gate_up, down = rnd(e, 2 * inter, h, std=0.02), rnd(e, h, inter, std=0.02)
    return x, ids, w.to(torch.bfloat16), gate_up, down


_OLD_TILES = mg.GemmTiles(
    64, 64, 4, 1
)  # the tiles before plans (64^3, 4 warps), loads not pipelined
MOE_SWEEP_OLD = mg.GroupedPlan(64, _OLD_TILES, _OLD_TILES)
# (block_m, GemmTiles) per kernel, likeliest first (the sweep stops at its time budget)
MOE_SWEEP_GATE_UP = [
    (128, mg.GemmTiles(64, 64, 8, 4, True)),
    (128, mg.GemmTiles(64, 64, 8, 3, True)),
    (128, mg.GemmTiles(128, 64, 8, 3, True)),
    (64, mg.GemmTiles(64, 64, 4, 3, True)),
    (128, mg.GemmTiles(64, 64, 8, 4)),
    (64, mg.GemmTiles(128, 64, 8, 3, True)),
    (128, mg.GemmTiles(64, 64, 4, 3, True)),
    (64, mg.GemmTiles(64, 64, 4, 3)),
]
MOE_SWEEP_DOWN = [
    (128, mg.GemmTiles(128, 64, 8, 4, True)),
    (128, mg.GemmTiles(128, 64, 8, 3, True)),
    (128, mg.GemmTiles(64, 64, 4, 4, True)),
    (64, mg.GemmTiles(128, 64, 8, 4, True)),
    (128, mg.GemmTiles(128, 64, 8, 4)),
    (128, mg.GemmTiles(256, 64, 8, 3, True)),
    (64, mg.GemmTiles(64, 64, 4, 3, True)),
    (64, mg.GemmTiles(64, 64, 4, 3)),
]


def moe_sweep(cfg: DeepseekV4Config, rows: int, dev: torch.device, iters: int,
              budget_s: float = 22.0) -> dict:  # fmt: skip
    """Each grouped GEMM kernel at ``rows`` tokens per candidate (block_m, `GemmTiles`):
    microseconds, TFLOP/s and max|diff| against the old launch (first row of each); then the
    whole `moe_grouped` under the old launch, the default plan and the fastest pair of one
    ``block_m``, and the pair grouping: the Triton launches (`group_pairs_triton`, the path's
    own, with the weights) vs torch's one-hot count and radix sort. Candidates past
    ``budget_s`` seconds are skipped."""
    x, ids, w, gate_up, down = moe_sweep_inputs(cfg, rows, dev)
    limit, t0, (t, k), e = cfg.swiglu_limit, time.perf_counter(), ids.shape, gate_up.shape[0]
    inter, hidden = down.shape[2], down.shape[1]
    groups = {bm: mg.group_pairs(ids, e, bm) for bm in (64, 128)}
    w_s = w.reshape(-1)[groups[64].order].contiguous()  # the same order for every block_m
    h_ref = mg.grouped_gate_up(x, gate_up, groups[64], limit, MOE_SWEEP_OLD)
    c_ref = mg.grouped_down(h_ref, down, w_s, groups[64], MOE_SWEEP_OLD)
    flops = {"gate_up": 2.0 * t * k * hidden * 2 * inter, "down": 2.0 * t * k * inter * hidden}
    found: dict[str, list[dict]] = {"gate_up": [], "down": []}
    for kind, cands in (("gate_up", MOE_SWEEP_GATE_UP), ("down", MOE_SWEEP_DOWN)):
        for bm, tiles in [(64, _OLD_TILES)] + cands:
            if time.perf_counter() - t0 > budget_s:
                print(f"  {kind} bm {bm} {tiles}: past the {budget_s:.0f} s budget, skipped")
                continue
            plan, g = mg.GroupedPlan(bm, tiles, tiles), groups[bm]
            if kind == "gate_up":
                fn, ref = lambda p=plan, g=g: mg.grouped_gate_up(x, gate_up, g, limit, p), h_ref
            else:
                fn, ref = lambda p=plan, g=g: mg.grouped_down(h_ref, down, w_s, g, p), c_ref
            try:
                diff = (fn().float() - ref.float()).abs().max().item()
                us = time_cuda(fn, iters, False)
            except Exception as exc:  # e.g. out of shared memory: report, keep sweeping
                print(f"  {kind} bm {bm} {tiles}: {type(exc).__name__}, skipped")
                continue
            found[kind].append(dict(block_m=bm, tiles=tiles, us=us, max_abs_diff=diff,
                                    tflops=flops[kind] / us / 1e6,
                                    old=tiles is _OLD_TILES))  # fmt: skip
    pairs = [
        (gu["us"] + dn["us"], mg.GroupedPlan(bm, gu["tiles"], dn["tiles"]))
        for bm in (64, 128)
        for gu in found["gate_up"] if gu["block_m"] == bm
        for dn in found["down"] if dn["block_m"] == bm
    ]  # fmt: skip
    default = mg.grouped_plan(t * k, e, x.dtype)
    best = min(pairs, key=lambda p: p[0])[1] if pairs else default
    whole = {}
    for name, plan in (("old", MOE_SWEEP_OLD), ("default", default), ("best", best)):
        fn = lambda p=plan: mg.moe_grouped_triton(x, ids, w, gate_up, down, limit, plan=p)  # noqa: E731
        whole[name] = dict(plan=repr(plan), us=time_cuda(fn, iters, False))
    saved = mg.COUNT_SORT_MAX_CELLS
    try:
        grouping = {
            "triton": time_cuda(lambda: mg.group_pairs_triton(ids, e, 128, w), iters, False)
        }
        mg.COUNT_SORT_MAX_CELLS = 1 << 62
        grouping["count"] = time_cuda(lambda: mg.group_pairs(ids, e, 128), iters, False)
        mg.COUNT_SORT_MAX_CELLS = 0
        grouping["radix_sort"] = time_cuda(lambda: mg.group_pairs(ids, e, 128), iters, False)
    finally:
        mg.COUNT_SORT_MAX_CELLS = saved
    for kind in found:
        found[kind].sort(key=lambda r: r["us"])
        for r in found[kind]:
            r["tiles"] = repr(r["tiles"])
    return dict(rows=rows, kernels=found, whole=whole, grouping_us=grouping,
                seconds=time.perf_counter() - t0)  # fmt: skip


def print_moe_sweep(res: dict) -> None:
    print(f"grouped MoE GEMMs at T={res['rows']} ({res['seconds']:.1f} s), fastest first:")
    for kind, found in res["kernels"].items():
        for r in found:
            print(f"  {kind:8}{' old' if r['old'] else '    '} bm {r['block_m']:3d} "
                  f"{r['tiles']:76} {r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s  "
                  f"max|diff| {r['max_abs_diff']:.3g}")  # fmt: skip
    old_us = res["whole"]["old"]["us"]
    for name, r in res["whole"].items():
        print(f"  moe_grouped {name:8} {r['us']:8.1f} us (x{old_us / r['us']:.2f} vs old)  "
              f"{r['plan']}")  # fmt: skip
    print("  group_pairs: " + ", ".join(f"{k} {v:.1f} us" for k, v in res["grouping_us"].items()))


def time_cuda(fn, iters: int, graph: bool) -> float:
    """Median microseconds per call (CUDA events), eager or as a replayed CUDA graph."""
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(name: str, fns, cuda: bool, iters: int, paths=("torch", "new")) -> list[dict]:
    torch_fn, new_fn = fns
    with torch.no_grad():
        want, got = torch_fn(), new_fn()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
        rows = []
        for path, fn in zip(paths, (torch_fn, new_fn)):
            row = dict(piece=name, path=path, max_abs_diff=diff)
            if cuda:
                row["eager_us"] = time_cuda(fn, iters, graph=False)
                row["graph_us"] = time_cuda(fn, iters, graph=True)
                row["kernels"] = kernels_per_call(fn)
            else:
                t0 = time.perf_counter()
                fn()
                row["eager_us"] = (time.perf_counter() - t0) * 1e6
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU: interpreter)")
    ap.add_argument("--rows", type=int, default=32, help="T, rows per call")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per measurement")
    ap.add_argument("--hc-rows", default="32,4096", help="rows of the hc_post_pre pieces")
    ap.add_argument("--sweep", action="store_true", help="time hc_pre over launch plans (GPU)")
    ap.add_argument("--hc-only", action="store_true", help="only the hyper-connection pieces")
    ap.add_argument(
        "--hc-sweep",
        action="store_true",
        help="time the row-tiled hc kernels over row tiles (GPU, largest --hc-rows)",
    )
    ap.add_argument(
        "--proj-programs",
        default="",
        help="only time hc_pre at --rows for each of these comma-separated program targets "
        "of its projection (GPU)",
    )
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--moe-rows", type=int, default=8192, help="T of the grouped MoE sweep")
    ap.add_argument("--moe-sweep", action="store_true", help="only the grouped MoE sweep (GPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = config(args.quick or not cuda)
    if args.moe_sweep:  # alone: the sweep's compiles fit its time budget
        res = moe_sweep(config(False), args.moe_rows, dev, 10) if cuda else {}
        print_moe_sweep(res) if res else print("--moe-sweep needs a GPU")
        if args.out and res:
            with open(args.out, "w") as fh:
                json.dump(dict(bench="bench_dsv4_blocks", command=" ".join(sys.argv),
                               device=torch.cuda.get_device_name(), moe_sweep=res), fh, indent=1)  # fmt: skip
        return
    hc, moe, d = build(cfg, args.rows, dev, torch.bfloat16)
    targets = [int(v) for v in args.proj_programs.split(",") if v]
    if targets:  # alone: the projection's program targets at --rows
        proj = sweep_proj_programs(hc, d, args.iters, targets) if cuda else []
        for r in proj:
            print(f"hc_pre at T={args.rows}, projection target {r['programs']:5d} programs "
                  f"({r['splits']} splits): {r['graph_us']:8.1f} us")  # fmt: skip
        if args.out and proj:
            with open(args.out, "w") as fh:
                json.dump(dict(bench="bench_dsv4_blocks", command=" ".join(sys.argv),
                               device=torch.cuda.get_device_name(), rows=args.rows,
                               proj_programs=proj), fh, indent=1)  # fmt: skip
        return
    rows = []
    rows += measure("hc", hc_fns(hc, d), cuda, args.iters)
    if not args.hc_only:
        rows += measure("moe", moe_fns(moe, d), cuda, args.iters)
        rows += measure("rms_norm", norm_fns(d, cfg.rms_norm_eps), cuda, args.iters)
    for r in (int(v) for v in args.hc_rows.split(",")) if cuda else (5,):
        fns = post_pre_fns(hc, r, dev, torch.bfloat16)
        rows += measure(f"hc_post_pre@{r}", fns, cuda, args.iters, ("unfused", "fused"))
        fns = post_pre_fns(hc, r, dev, torch.bfloat16, norm=True)
        rows += measure(f"hc_pp_norm@{r}", fns, cuda, args.iters, ("unfused", "fused"))
        fns = projection_form_fns(hc, r, dev)  # both forms at every size (decode ones too)
        rows += measure(f"hc_pre@{r}", fns, cuda, args.iters, ("ieee", "tensor-core"))
        if r > hcm.ROW_TILED_MIN_ROWS or not cuda:
            for op in ("pre", "post"):
                fns = row_tiled_fns(hc, r, dev, op)
                rows += measure(f"hc_{op}_rows@{r}", fns, cuda, args.iters, ("one-tok", "rows"))
    sweep = sweep_plans(hc, d, args.iters) if args.sweep and cuda else []
    big = [int(v) for v in args.hc_rows.split(",") if int(v) > hcm.ROW_TILED_MIN_ROWS]
    tiles = sweep_row_tiles(hc, big[-1], dev, args.iters) if args.hc_sweep and cuda and big else []
    print(
        f"{'piece':16} {'path':8} {'eager us':>9} {'graph us':>9} {'kernels':>8} {'max|diff|':>10}"
    )
    for r in rows:
        print(f"{r['piece']:16} {r['path']:8} {r['eager_us']:9.1f} {r.get('graph_us', 0):9.1f} "
              f"{r.get('kernels', -1):8d} {r['max_abs_diff']:10.3g}")  # fmt: skip
    if sweep:
        print(f"hc_pre plans at T={args.rows} (tile_t x tile_h x programs x proj warps x "
              "epilogue warps), fastest first:")  # fmt: skip
        for r in sweep[:12]:
            fused = r.get("post_pre_graph_us")
            tail = "" if fused is None else f"   hc_post_pre {fused:8.1f} us"
            print(f"  {r['plan']:18} splits {r['splits']:4d} {r['graph_us']:8.1f} us{tail}")
    for a, b in zip(rows, rows[1:]):  # old vs new of the row-tiled pieces
        if a["piece"] == b["piece"] and a["path"] == "one-tok" and "graph_us" in a:
            fast = "rows" if b["graph_us"] < a["graph_us"] else "one-tok"
            print(f"{a['piece']}: {fast} is faster ({a['graph_us']:.1f} vs {b['graph_us']:.1f} "
                  f"us, x{a['graph_us'] / b['graph_us']:.2f}), bitwise equal: "
                  f"{a['max_abs_diff'] == 0}")  # fmt: skip
    if tiles:
        print(f"row tiles at T={big[-1]} (tile_t x tile_h x warps), fastest first per op:")
        for op in ("pre", "post"):
            for r in [r for r in tiles if r["op"] == op][:5]:
                print(f"  hc_{op}_rows {r['tile']:12} {r['graph_us']:8.1f} us")
    record = dict(
        bench="bench_dsv4_blocks", date=datetime.datetime.now(datetime.UTC).isoformat(),
        device=torch.cuda.get_device_name() if cuda else "cpu", command=" ".join(sys.argv),
        rows_per_call=args.rows, hidden=cfg.hidden_size, hc_mult=cfg.hc_mult,
        sinkhorn_iters=cfg.hc_sinkhorn_iters, experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok, moe_inter=cfg.moe_intermediate_size, results=rows,
        hc_pre_plans=sweep, row_tiles=tiles,
    )  # fmt: skip
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
