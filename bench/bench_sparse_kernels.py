"""Old vs new Triton kernels of ``kvplan.ops.sparse_attention`` at DeepSeek-V4 decode shapes.

Cases (``--rows`` query rows, 32 by default):

* ``index_scores``: 32 index heads x 128, bf16 queries, every row scoring its own
  ``--candidates`` compressed entries (8,192 and 32,768: 32K and 128K context at ratio 4) in
  an FP8 index layout with UE8M0 scales (``mxfp8``) and with fp32 scales (``fp8_fp32sf``).
  old = ``index_scores_triton(legacy=True)`` (CUDA-core fp32 products, one key tile per
  program); new = the default (tensor cores for bf16 queries).
* ``topk``: the indexer's top-512 of every row's candidates (random fp32 scores, mapped
  through a slot table); old = the default launch, new = digit widths / chunks / warps and the
  compacting search (later passes over the first pass's bin only).
* ``sparse_attention``: 16 heads x 512, bf16 queries, a 128-slot SWA ring plus compressed
  entries, both V41 FP8 caches read in place: CSA (512 chosen entries) and HCA (256 and
  1,024 entries). old = one program per (row, head group) (``num_splits=1``); new = the
  default (split columns when the rows leave SMs idle).

Every new result is checked against the old one (max |new - old| / max |old| over finite
entries; the run fails above 1e-5 for the scores, 2e-2 for the bf16 attention). Times: ``triton.testing.do_bench`` median on CUDA, eager ("ms": host launch
cost included) and per call of 20 calls replayed as a CUDA graph ("graph ms", GPU time; the
speedup column compares these); on a CPU (``--quick``, tiny
shapes) the interpreter's wall time, for a smoke run only. ``--sweep`` also times a grid of
tile configurations of the new kernels; on CUDA the attention cases (decode, and prefill
with ``--prefill-rows``) always time the ``d_chunk`` / ``pv_split`` variants; the fastest
path of each case is printed last.

    PYTHONPATH=. python3 bench/bench_sparse_kernels.py --out bench/results/sparse_kernels.json
    PYTHONPATH=. python3 bench/bench_sparse_kernels.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from kvplan.backends.hybrid.storage import PagedRows, exact_format, index_format  # noqa: E402
from kvplan.formats import V41_FORMAT  # noqa: E402
from kvplan.ops.index_scores import index_scores_by_sequence  # noqa: E402
from kvplan.ops.sparse_attention import (  # noqa: E402
    KeySource,
    index_scores_triton,
    sparse_attention_triton,
)
from kvplan.ops.topk import topk_columns_triton  # noqa: E402

# new vs old, relative to max |old|: fp32 scores summed in another order; bf16 outputs whose
# probabilities are rounded to bf16 against another running max
_TOL = {"index_scores": 1e-5, "index_prompt": 1e-5, "sparse_attention": 2e-2, "topk": 0.0}
# d_chunk / pv_split variants (bench/hybrid_kernel_regs.py has their register counts)
_CHUNKED = [
    {"d_chunk": dc, "pv_split": ps, "num_warps": nw, "num_stages": st}
    for dc, ps, nw, st in ((64, 1, 8, 2), (64, 4, 8, 1), (64, 4, 8, 2), (32, 4, 8, 1),
                           (128, 4, 8, 1), (128, 4, 8, 2), (64, 4, 4, 1), (64, 2, 8, 1))
]  # fmt: skip


def timed_ms(fn, dev: torch.device) -> float:
    """Median milliseconds per call."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def graph_ms(fn, dev: torch.device, calls: int = 20) -> float | None:
    """Median milliseconds per call of ``calls`` back-to-back calls replayed as one CUDA graph
    (GPU time without host overhead); None on a CPU."""
    if dev.type != "cuda":
        return None
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return float(ms) / calls


def timing(fn, dev: torch.device) -> dict:
    return {"ms": timed_ms(fn, dev), "graph_ms": graph_ms(fn, dev)}


def rel_err(new: torch.Tensor, old: torch.Tensor) -> float:
    fin = torch.isfinite(old)
    if not torch.equal(fin, torch.isfinite(new)):
        return float("inf")
    scale = float(old[fin].abs().max()) if fin.any() else 1.0
    return float((new[fin].float() - old[fin].float()).abs().max()) / max(scale, 1e-30)


def paged_slots(num_rows, per_row, layout, width, block_size, dev, gen):
    """A PagedRows holding ``per_row`` random rows for each query row (its own blocks, in a
    random block order) and int32 ``[T, per_row]`` slots naming them in order."""
    blocks_per_row = -(-per_row // block_size)
    rows = PagedRows(num_rows * blocks_per_row, block_size, layout, width, device=dev)
    n = num_rows * blocks_per_row * block_size
    for lo in range(0, n, 1 << 18):
        hi = min(n, lo + (1 << 18))
        rows.store(torch.randn(hi - lo, width, generator=gen, device=dev),
                   torch.arange(lo, hi, dtype=torch.int32, device=dev))  # fmt: skip
    perm = torch.randperm(num_rows * blocks_per_row, generator=gen, device=dev)
    perm = perm.view(num_rows, blocks_per_row).to(torch.int32)
    col = torch.arange(per_row, dtype=torch.int32, device=dev)
    slots = perm[:, col // block_size] * block_size + col % block_size
    return rows, slots.contiguous()


def compare(name: str, call, configs: list[dict], old_cfg: dict, dev) -> list[dict]:
    """Rows for ``call(**old_cfg)`` ("old") and ``call(**cfg)`` for each of ``configs``
    ("new" for ``{}``), each new one checked against the old result."""
    old = call(**old_cfg)
    out = [{"case": name, "path": "old", **timing(lambda: call(**old_cfg), dev)}]
    for cfg in configs:
        path = f"new {cfg}" if cfg else "new"
        try:
            new = call(**cfg)
        except Exception as e:  # noqa: BLE001 - a sweep config may not compile
            out.append({"case": name, "path": path, "error": repr(e)[:200]})
            continue
        t = timing(lambda cfg=cfg: call(**cfg), dev)
        out.append({"case": name, "path": path, **t, "rel_err": rel_err(new, old)})
    return out


def index_case(a, dev, gen, kind: str, cand: int) -> list[dict]:
    layout = index_format("fp8", kind, 128, torch.bfloat16)
    rows, slots = paged_slots(a.rows, cand, layout, 128, 64, dev, gen)
    q = torch.randn(a.rows, a.index_heads, 128, generator=gen, device=dev).to(torch.bfloat16)
    w = torch.randn(a.rows, a.index_heads, generator=gen, device=dev)
    src = rows.key_source(slots)
    configs = [{}]
    if a.sweep_stages:  # key tiles per program x software pipelining
        configs += [{"tile_n": n, "tiles": t, "num_warps": nw, "num_stages": st}
                    for n in (64, 128) for t in (2, 4, 8) for nw in (4, 8) for st in (2, 3, 4)
                    if n * t <= 1024]  # fmt: skip
    if a.sweep:
        configs += [{"tile_n": n, "tiles": t, "num_warps": nw}
                    for n in (64, 128, 256) for t in (1, 2, 4, 8) for nw in (4, 8)
                    if n * t <= 1024]  # fmt: skip
        configs += [{"tile_n": 32, "tiles": 1, "num_warps": nw} for nw in (1, 2, 4)]
        configs += [{"tile_n": 64, "tiles": 1, "num_warps": nw} for nw in (1, 2)]

    def call(**cfg):
        return index_scores_triton(q, w, src, **cfg)

    name = f"index_scores {kind} {a.rows}x{cand}"
    return compare(name, call, configs, {"legacy": True}, dev)


def topk_case(a, dev, gen, cand: int) -> list[dict]:
    """The indexer's top-k of a decode step: ``a.rows`` rows of ``cand`` fp32 scores (every
    column eligible), ``a.top_k`` winners mapped through a slot table. old = the default
    launch; the sweep: digit width, chunk, the compacting search, the in-register row and
    the split search (the same winners, bit for bit). ``a.topk_width`` (when larger) widens
    the rows past the ``cand`` eligible columns, as a captured decode step's rows are
    ``max_model_len // ratio`` wide."""
    width = max(cand, a.topk_width or 0)
    scores = torch.randn(a.rows, width, generator=gen, device=dev)
    count = torch.full((a.rows,), cand, dtype=torch.int32, device=dev)
    slots = torch.randperm(a.rows * width, generator=gen, device=dev).to(torch.int32)
    slots = slots.view(a.rows, width)
    configs = [{"bits": b, "tile": t, "num_warps": 8} for b in (6, 8) for t in (2048, 4096)]
    configs += [{"compact": True, "bits": b, "tile": 2048, "num_warps": 8} for b in (5, 8)]
    if width <= 16384:  # the whole row in registers
        configs += [{"row": True, "bits": b} for b in (5, 6, 8)]
    # session 53's forms (off by default): a row a little wider than a power of two keeps that
    # power in registers plus a tail (the plan's one stage, and by digit width), its winners
    # written from the registers or from the row read again
    configs += [{"row": True, "tail": True, "reg_write": w} for w in (True, False)]
    configs += [{"row": True, "tail": True, "bits": b, "reg_write": True} for b in (6, 8)]
    configs += [{"row": True, "part": p, "bits": b}
                for p in (2048, 4096, 8192, 16384) for b in (5, 6) if p < width]  # fmt: skip
    configs += [{"row": False, "part": 8192, "bits": 5}] if width > 8192 else []
    if dev.type != "cuda":
        configs = [{"bits": 8, "tile": 64, "num_warps": 1},
                   {"compact": True, "bits": 5, "tile": 64, "num_warps": 1},
                   {"row": True, "part": 32, "bits": 5}]  # fmt: skip

    def call(**cfg):
        return topk_columns_triton(scores, count, a.top_k, gather=slots, **cfg)

    name = f"topk {a.rows}x{cand}" + (f" of {width}" if width > cand else "")
    return compare(name, call, configs, {}, dev)


def attention_case(a, dev, gen, ring, ring_slots, label: str, entries: int, chosen: int):
    pool, pool_slots = paged_slots(a.rows, entries, a.attention_layout, 512, 64, dev, gen)
    if chosen < entries:  # CSA: a random choice of the row's entries
        pick = torch.rand(a.rows, entries, generator=gen, device=dev).argsort(dim=1)
        pool_slots = pool_slots.gather(1, pick[:, :chosen]).contiguous()
    q = torch.randn(a.rows, a.heads, 512, generator=gen, device=dev).to(torch.bfloat16)
    sinks = torch.randn(a.heads, generator=gen, device=dev)
    srcs = [ring.key_source(ring_slots), pool.key_source(pool_slots)]
    configs = [{}] if dev.type == "cuda" else [{"num_splits": 2}]  # CPU: split anyway
    configs += [{"num_splits": int(s)} for s in a.splits.split(",") if s]
    if a.sweep:
        configs += [{"num_splits": s, "tile_n": n, "num_warps": nw}
                    for s in (4, 8, 16) for n in (16, 32, 64) for nw in (4, 8)]  # fmt: skip
    if a.attention_sweep == "stages":  # large decode batches: splits, tiles and pipelining
        configs += [{"num_splits": s, "tile_n": n, "num_warps": nw, "num_stages": st}
                    for n, nw in ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8)) for s in (1, 2, 4)
                    for st in (2, 3)]  # fmt: skip
    elif dev.type == "cuda" and not a.no_chunked:  # the register-footprint variants
        configs += [dict(v, **({"num_splits": s} if s else {}))
                    for s in (None, 8) for v in _CHUNKED]  # fmt: skip

    def call(**cfg):
        return sparse_attention_triton(q, srcs, sinks, 512**-0.5, check=False, **cfg)

    fmt = "" if a.attention_format == "v41" else f" {a.attention_format}"
    name = f"sparse_attention {label}{fmt} {a.rows}x{a.heads}x512 {a.window}+{chosen}"
    return compare(name, call, configs, {"num_splits": 1}, dev)


def prefill_case(a, dev, gen) -> list[dict]:
    """Prefill-shaped CSA attention: ``a.prefill_rows`` consecutive query rows of one
    sequence, row t reading ring entries t .. t + window - 1 of a shared ring and ``top_k``
    random entries of a shared pool of ``csa_pool`` (neighbours share most keys, as in a
    prompt chunk); one program per (row, head group), the tiling swept."""
    n = a.prefill_rows
    ring, ring_all = paged_slots(1, n + a.window, V41_FORMAT, 512, 128, dev, gen)
    cols = torch.arange(a.window, device=dev)[None, :] + torch.arange(n, device=dev)[:, None]
    ring_slots = ring_all[0][cols].contiguous()
    pool, pool_all = paged_slots(1, a.csa_pool, V41_FORMAT, 512, 64, dev, gen)
    pick = torch.rand(n, a.csa_pool, generator=gen, device=dev).argsort(dim=1)[:, : a.top_k]
    pool_slots = pool_all[0][pick].contiguous()
    q = torch.randn(n, a.heads, 512, generator=gen, device=dev).to(torch.bfloat16)
    sinks = torch.randn(a.heads, generator=gen, device=dev)
    if a.prefill_sources == "bf16":  # as the model's prompt path hands them: bf16 rows
        ring_rows = ring.load_slots(ring_all[0]).to(torch.bfloat16)
        pool_rows = pool.load_slots(pool_all[0]).to(torch.bfloat16)
        srcs = [KeySource(ring_rows, cols.to(torch.int32).contiguous()),
                KeySource(pool_rows, pick.to(torch.int32).contiguous())]  # fmt: skip
    else:  # the V41 records read in place
        srcs = [ring.key_source(ring_slots), pool.key_source(pool_slots)]
    tiles = ((16, 4, 2), (16, 8, 1), (32, 4, 2), (32, 8, 2), (64, 4, 2)) if a.prefill_short else [
        (tn, nw, st) for tn in (16, 32, 64) for nw in (4, 8) for st in (1, 2, 3)]  # fmt: skip
    configs = [{}] + [
        {"num_splits": 1, "tile_n": tn, "num_warps": nw, "num_stages": st} for tn, nw, st in tiles
    ] + [dict(v, num_splits=1) for v in _CHUNKED]  # fmt: skip

    def call(**cfg):
        return sparse_attention_triton(q, srcs, sinks, 512**-0.5, check=False, **cfg)

    name = f"sparse_attention prefill {n}x{a.heads}x512 {a.window}+{a.top_k}"
    return compare(name, call, configs, {"num_splits": 1}, dev)


def attention_cases(a, dev, gen) -> list[dict]:
    ring, ring_slots = paged_slots(a.rows, a.window, a.attention_layout, 512, a.window, dev, gen)
    out = attention_case(a, dev, gen, ring, ring_slots, "CSA", a.csa_pool, a.top_k)
    for n in a.hca_entries:
        out += attention_case(a, dev, gen, ring, ring_slots, "HCA", n, n)
    return out


def index_prompt_case(a, dev, gen, kind: str) -> list[dict]:
    """Prompt-shaped indexer scores: ``a.prompt_seqs`` sequences of ``a.prompt_rows`` rows,
    each row seeing a rising prefix of its sequence's ``a.prompt_cand`` candidates (a 4K
    prompt's CSA entries). old = every row scoring its own table (``index_scores_triton``),
    new = `index_scores_by_sequence` (a key tile loaded once for several rows)."""
    layout = index_format("fp8", kind, 128, torch.bfloat16)
    n_seq, per, cand = a.prompt_seqs, a.prompt_rows, a.prompt_cand
    rows, slots = paged_slots(n_seq, cand, layout, 128, 64, dev, gen)  # [S, cand]
    t = n_seq * per
    q = torch.randn(t, a.index_heads, 128, generator=gen, device=dev).to(torch.bfloat16)
    w = torch.randn(t, a.index_heads, generator=gen, device=dev)
    lens = (torch.arange(per, device=dev) * cand // per).repeat(n_seq).to(torch.int32)
    cu = np.arange(n_seq + 1) * per
    col = torch.arange(cand, device=dev)[None, :]
    table = torch.where(col < lens[:, None], slots.repeat_interleave(per, 0), -1)
    per_row = rows.key_source(table.to(torch.int32).contiguous())
    by_seq = rows.key_source(slots)
    configs = [{}] + [{"rows_per_program": r, "tile_n": n, "num_warps": nw}
                      for r in (2, 4, 8) for n in (32, 64, 128) for nw in (4, 8)
                      if r * n <= 512]  # fmt: skip

    def call(per_row_table=False, **cfg):
        if per_row_table:
            return index_scores_triton(q, w, per_row)
        return index_scores_by_sequence(q, w, by_seq, cu, lens, check=False, **cfg)

    name = f"index_prompt {kind} {n_seq}x{per}x{cand}"
    return compare(name, call, configs, {"per_row_table": True}, dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also time tile configurations")
    ap.add_argument(
        "--rows",
        type=int,
        default=None,
        help="decode rows of the index / top-k / attention cases (default 32)",
    )
    ap.add_argument("--candidates", default=None,
                    help="comma-separated candidates per row of the index / top-k cases "
                    "(default 8192,32768)")  # fmt: skip
    ap.add_argument("--topk-width", type=int, default=0,
                    help="top-k cases: columns per row when more than the candidates (a "
                    "captured decode step's max_model_len // ratio)")  # fmt: skip
    ap.add_argument(
        "--index-kinds",
        default="mxfp8,fp8_fp32sf",
        help="comma-separated index layouts of the index cases",
    )
    ap.add_argument(
        "--hca-entries",
        default="256,1024",
        help="comma-separated compressed entries of the HCA attention cases",
    )
    ap.add_argument("--attention-sweep", choices=("chunked", "stages"), default="chunked",
                    help="decode attention variants: the register-footprint ones (chunked) or "
                    "splits x tiles x num_stages (stages)")  # fmt: skip
    ap.add_argument("--splits", default="",
                    help="decode attention cases: also these comma-separated split counts, "
                    "default tiling otherwise")  # fmt: skip
    ap.add_argument(
        "--no-chunked",
        action="store_true",
        help="decode attention cases: the default launch only, no register-footprint variants",
    )
    ap.add_argument("--attention-format", choices=("v41", "bf16"), default="v41",
                    help="decode attention cases' caches: V41 fp8 records (kv_format fp8) or "
                    "bf16 rows (kv_format exact)")  # fmt: skip
    ap.add_argument(
        "--sweep-stages",
        action="store_true",
        help="index cases: also tiles per program x num_stages",
    )
    ap.add_argument("--only", choices=("index", "index_prompt", "topk", "attention", "prefill"),
                    default=None,
                    help="prefill: only the --prefill-rows case")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--prefill-rows", type=int, default=0,
                    help="also a prefill-shaped CSA case of this many rows, tiling swept")  # fmt: skip
    ap.add_argument("--prefill-sources", choices=("bf16", "fp8"), default="bf16",
                    help="prefill case keys: bf16 rows (the model's prompt path) or V41 "
                    "records in place")  # fmt: skip
    ap.add_argument("--prefill-short", action="store_true",
                    help="prefill case: 4 tilings + the register variants, not the full grid")  # fmt: skip
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = a.quick or dev.type == "cpu"
    a.rows = a.rows or (2 if quick else 32)
    a.index_heads = 4 if quick else 32
    a.candidates = ([int(c) for c in a.candidates.split(",")] if a.candidates
                    else [96] if quick else [8192, 32768])  # fmt: skip
    a.heads, a.window, a.top_k = (4, 16, 24) if quick else (16, 128, 512)
    a.csa_pool = 64 if quick else 8192
    a.attention_layout = (V41_FORMAT if a.attention_format == "v41"
                          else exact_format(512, torch.bfloat16))  # fmt: skip
    a.hca_entries = [40] if quick else [int(n) for n in a.hca_entries.split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    if a.only in (None, "index"):
        for kind in a.index_kinds.split(","):
            for cand in a.candidates:
                rows += index_case(a, dev, gen, kind, cand)
    a.prompt_seqs, a.prompt_rows, a.prompt_cand = (2, 12, 40) if quick else (2, 4096, 1024)
    if a.only in (None, "index_prompt"):
        for kind in ("mxfp8", "fp8_fp32sf"):
            rows += index_prompt_case(a, dev, gen, kind)
    if a.only in (None, "topk"):
        for cand in a.candidates:
            rows += topk_case(a, dev, gen, cand)
    if a.only in (None, "attention"):
        rows += attention_cases(a, dev, gen)
    if a.only == "prefill" and not a.prefill_rows:
        a.prefill_rows = 64 if quick else 8192
    if a.prefill_rows:
        rows += prefill_case(a, dev, gen)
    base = {}
    print(f"{'case':<46} {'path':<48} {'ms':>8} {'graph ms':>8} {'x old':>6} {'rel_err':>9}")
    for r in rows:
        if r["path"] == "old":
            base[r["case"]] = r
        if "error" in r:
            print(f"{r['case']:<46} {r['path']:<48} error: {r['error'][:60]}")
            continue
        key = "graph_ms" if r["graph_ms"] is not None else "ms"
        r["speedup"] = base[r["case"]][key] / r[key]
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else ""
        g = f"{r['graph_ms']:8.4f}" if r["graph_ms"] is not None else f"{'-':>8}"
        print(f"{r['case']:<46} {r['path']:<48} {r['ms']:8.4f} {g} {r['speedup']:6.2f} {err:>9}")
    record = {
        "bench": "sparse_kernels",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "torch": torch.__version__,
        "rows": rows,
    }
    for case in dict.fromkeys(r["case"] for r in rows):
        timed = [r for r in rows if r["case"] == case and "speedup" in r]
        best = max(timed, key=lambda r: r["speedup"])
        print(f"FASTEST {case}: {best['path']} ({best['speedup']:.2f}x old)")
    bad = [r for r in rows if r.get("rel_err", 0.0) > _TOL[r["case"].split()[0]]]
    for r in bad:
        print(f"MISMATCH {r['case']} {r['path']}: rel_err {r['rel_err']:.2e}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
