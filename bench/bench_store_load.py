"""Benchmark store_kv_cache and load_paged_kv_cache against a device-to-device copy and plain
PyTorch, measured side by side in the same run.

For each format (V41, V41_FP4, the three index formats MXFP8_INDEX, FP4_INDEX and
FP8_FLOAT32_SF_INDEX, BF16 x512) and token count (default 4K, 64K, 256K) it times, on the same
device:

* ``triton``: the kernel (``store_kv_cache_triton`` / ``load_paged_kv_cache_triton``; tokens
  scattered over a shuffled block table, block_size 64, ``out=`` preallocated);
* ``torch``: plain PyTorch -- ``kvplan.quant`` torch quantization ops + ``index_put_`` into the
  value/scale views (store); advanced-index gather + torch dequantization (load);
* ``copy``: ``dst.copy_(src)`` moving as many bytes as the op reads + writes.

Effective bandwidth = (bytes read + bytes written) / median time; ``ratio`` is that over the
copy's bandwidth (eager calls: includes any host launch overhead the GPU waits for);
``graph`` is the same ratio for the GPU time per call of 20 calls replayed from one CUDA graph
(no host overhead; no L2 flush between those calls); ``host us`` is the CPU time per call of
the Python wrapper + launch (20 calls enqueued back to back, no sync inside). An eager time far
above the graph time while ``host us`` exceeds the ~60 us L2 flush that ``do_bench`` puts
before each call means the eager figure measures the host, not the kernel. SM clocks are warmed up before each
timing. ``--sweep`` first tries a few launch configurations at the middle size and
keeps the fastest (printed and recorded). Finally, at 256 tokens, 50 back-to-back calls are
captured in one CUDA graph (library default launch parameters, which shrink the tiles for small
batches) and the per-call replay time is compared with an empty kernel's.

    PYTHONPATH=. python3 bench/bench_store_load.py --sweep --out bench/results/store_load.json
    PYTHONPATH=. python3 bench/bench_store_load.py --quick       # tiny, runs on a CPU too
    PYTHONPATH=. python3 bench/bench_store_load.py --host        # wrapper host time only

On CUDA, times come from ``triton.testing.do_bench`` (L2 flushed before each call, median).
On a CPU (``--quick``) the triton column is the interpreter, for debugging only.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import triton  # noqa: E402

from kvplan import quant  # noqa: E402
from kvplan.formats import (  # noqa: E402
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
    V41_FORMAT,
    V41_FP4_FORMAT,
    KVCacheFormat,
    alloc_kv_cache,
    bf16_format,
    split_kv_cache,
)
from kvplan.load_plan import BlockLoadPlanBuilder  # noqa: E402
from kvplan.ops.load import _alloc_out, load_paged_kv_cache_triton  # noqa: E402
from kvplan.ops.store import store_kv_cache_triton  # noqa: E402

FORMATS = {
    "V41_FORMAT": V41_FORMAT,
    "V41_FP4_FORMAT": V41_FP4_FORMAT,
    "MXFP8_INDEX_KV_FORMAT": MXFP8_INDEX_KV_FORMAT,
    "FP4_INDEX_KV_FORMAT": FP4_INDEX_KV_FORMAT,
    "FP8_FLOAT32_SF_INDEX_KV_FORMAT": FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    "BF16x512": bf16_format(512),
    # the dense engine's fp8 record at llama-1b's 8 KV heads x 64: searched fp32 scales per 32
    # (kv_format="fp8") and the same record with the plain amax / 448 rule
    "ENGINE_FP8x512": KVCacheFormat(
        "e4m3", 512, 32, 0, True, "fp32", "engine fp8 x512, searched", True, scale_search=True
    ),
    "FP8_AMAX_x512": KVCacheFormat("e4m3", 512, 32, 0, True, "fp32", "fp8 x512, amax/448", True),
    # the same for kv_format="fp4" (e2m1, e4m3 scale per 16): K's searched codes / the plain rule
    "ENGINE_FP4x512": KVCacheFormat(
        "e2m1", 512, 16, 0, True, "e4m3", "engine fp4 x512, searched", True, scale_search=True
    ),
    "FP4_PLAIN_x512": KVCacheFormat("e2m1", 512, 16, 0, True, "e4m3", "fp4 x512, plain", True),
}
# launch configurations tried by --sweep (hw=False: integer fp8/bf16 rounding instead of cvt)
STORE_SWEEP = [
    {},
    dict(rows=8, num_warps=4),
    dict(rows=16, num_warps=8),
    dict(rows=32, num_warps=4),
    dict(rows=32, num_warps=8),
    dict(rows=64, num_warps=8),
    dict(rows=8, num_warps=4, hw=False),
]
CAST_SWEEP = [
    {},
    dict(tile_t=8, num_warps=4),
    dict(tile_t=16, num_warps=8),
    dict(tile_t=32, num_warps=8),
    dict(tile_t=16, num_warps=8, hw=False),
]
# segs: segments (blocks) per program; the library default is chosen by
# kvplan.ops.load.raw_segments_per_program ({} = that default)
RAW_SWEEP = [
    {},
    dict(tile_t=16, num_warps=4),
    dict(tile_t=64, num_warps=4),
    dict(tile_t=64, num_warps=8),
    dict(tile_t=64, segs=2, num_warps=4),
    dict(tile_t=64, segs=4, num_warps=8),
    dict(tile_t=64, segs=8, num_warps=8),
]


def warm_up_clocks(device: torch.device, ms: float = 40.0) -> None:
    """Keep the GPU busy for ~ms so SM clocks are up before timing (the first GPU run showed
    slow, bimodal times right after CPU-side setup)."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)


def median_s(fn, device: torch.device, reps: int = 5) -> float:
    if device.type == "cuda":
        warm_up_clocks(device)
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


class Case:
    """Random K/V, a cache, slots through a shuffled block table and the matching load plan."""

    def __init__(self, layout, num_tokens: int, block_size: int, device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.layout, self.n = layout, num_tokens
        num_blocks = -(-num_tokens // block_size)
        self.cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
        self.kv = torch.randn(num_tokens, layout.elements, generator=g).bfloat16().to(device)
        table = torch.randperm(num_blocks, generator=g)
        pos = torch.arange(num_tokens)
        slots = table[pos // block_size] * block_size + pos % block_size
        self.slots = slots.to(torch.int32).to(device)
        self.block, self.offset = (self.slots.long() // block_size, self.slots.long() % block_size)
        builder = BlockLoadPlanBuilder(block_size)
        builder.append_paged_range(table.tolist(), 0, num_tokens)
        self.segments, self.total_k = builder.build(device)
        self.out = _alloc_out(layout, self.total_k, torch.device(device))
        self.views = split_kv_cache(self.cache, layout)
        bpt, elems = layout.bytes_per_token, layout.elements
        self.store_bytes = num_tokens * (2 * elems + bpt)
        if layout.do_cast or not layout.is_quantized:
            self.load_bytes = num_tokens * (bpt + 2 * elems)
        else:
            out_sf = self.out.scales.view(torch.uint8).reshape(num_tokens, -1).shape[1]
            self.load_bytes = num_tokens * (bpt + layout.quantized_bytes + out_sf)

    def store(self, config=None):
        store_kv_cache_triton(self.kv, self.cache, self.slots, layout=self.layout, check=False,
                              config=config)  # fmt: skip

    def load(self, config=None):
        load_paged_kv_cache_triton(self.cache, self.segments, self.total_k, self.out,
                                   layout=self.layout, check=False, config=config)  # fmt: skip

    def snapshot(self, op: str) -> list[torch.Tensor]:
        """Bytes the op wrote (cache storage for store, outputs for load)."""
        if op == "store":
            c = self.cache
            return [torch.as_strided(c, (c.shape[0], c.stride(0)), (c.stride(0), 1)).clone()]
        outs = self.out if isinstance(self.out, tuple) else (self.out,)
        return [t.view(torch.uint8).clone() for t in outs]

    def matches_torch(self, op: str, config=None) -> bool:
        """Run the kernel and the plain-PyTorch version; do they write the same bytes?"""
        getattr(self, op)(config)
        a = self.snapshot(op)
        getattr(self, f"{op}_torch")()
        b = self.snapshot(op)
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    def store_torch(self):
        values, scales = self.views
        if not self.layout.is_quantized:
            values[self.block, self.offset] = self.kv
            return
        v, s = quant.quantize(self.kv, self.layout)
        values.view(torch.uint8)[self.block, self.offset] = v
        scales.view(torch.uint8)[self.block, self.offset] = s

    def load_torch(self):
        values, scales = self.views
        if not self.layout.is_quantized:
            self.out[:] = values[self.block, self.offset]
            return
        v = values.view(torch.uint8)[self.block, self.offset]
        s = scales.view(torch.uint8)[self.block, self.offset]
        if self.layout.do_cast:
            self.out[:] = quant.dequantize(v, s, self.layout)
        else:
            self.out.values.view(torch.uint8)[:] = v
            self.out.scales.view(torch.uint8).view(self.n, -1)[:] = s


def host_per_call_s(fn, device, calls: int = 20) -> float:
    """CPU time per call to enqueue ``fn`` (wrapper + Triton launch), GPU work excluded."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (t1 - t0) / calls


def copy_time(nbytes: int, device) -> float:
    """Median time of a copy that reads nbytes / 2 and writes nbytes / 2."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_s(lambda: dst.copy_(src), device)


def sweep(case: Case, op: str, configs, device) -> tuple[dict, list]:
    fn = case.store if op == "store" else case.load
    tried = []
    for cfg in configs:
        try:
            t = median_s(lambda cfg=cfg: fn(cfg), device)
        except Exception as e:  # a config that does not compile is skipped, and recorded
            tried.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        tried.append({"config": cfg, "time_s": t})
    ok = [r for r in tried if "time_s" in r]
    return min(ok, key=lambda r: r["time_s"])["config"], tried


@triton.jit
def _empty_kernel(x_ptr):
    pass


def graph_per_call_s(fn, device, calls: int = 50) -> float:
    """GPU time per call of ``calls`` back-to-back calls captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return median_s(graph.replay, device) / calls


class _StubKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing (host-time mode)."""

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs) -> None:
    return None


def host_overhead(names, num_tokens: int, block_size: int, device, calls=200, reps=15):
    """Host time per call of the Python wrappers (``check=False``) with every kernel launch
    stubbed out, cached plan path vs. the same call with the plan caches cleared before each
    call (= the per-call validation and parameter work the wrapper did before the caches, plus
    filling the cache). Returns rows of medians in seconds."""
    from kvplan.ops import _load_kernels, _store_kernels
    from kvplan.ops import load as load_mod
    from kvplan.ops import store as store_mod

    kernels = [(_store_kernels, "store_quant_kernel"), (_store_kernels, "scatter_rows_kernel"),
               (_load_kernels, "load_cast_kernel"), (_load_kernels, "load_raw_kernel")]  # fmt: skip
    saved = [getattr(m, a) for m, a in kernels]
    rows = []
    try:
        for m, a in kernels:
            setattr(m, a, _StubKernel())
        for name in names:
            case = Case(FORMATS[name], num_tokens, block_size, device)
            ops = {
                "store": case.store,
                "load (out=)": case.load,
                "load (new out)": functools.partial(
                    load_paged_kv_cache_triton, case.cache, case.segments, case.total_k,
                    layout=case.layout, check=False,
                ),
            }  # fmt: skip
            for op, fn in ops.items():
                res = {}
                for mode in ("cached", "uncached"):

                    def call(fn=fn, mode=mode):
                        if mode == "uncached":
                            store_mod._PLANS.clear()
                            load_mod._PLANS.clear()
                        fn()

                    for _ in range(calls):
                        call()
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            call()
                        times.append((time.perf_counter() - t0) / calls)
                    res[mode] = sorted(times)[reps // 2]
                rows.append({"format": name, "op": op, "tokens": num_tokens,
                             "host_cached_s": res["cached"], "host_uncached_s": res["uncached"],
                             "uncached_over_cached": res["uncached"] / res["cached"]})  # fmt: skip
                print(f"{name:<31}{op:<16}{res['uncached'] * 1e6:>10.2f}{res['cached'] * 1e6:>10.2f}"
                      f"{res['uncached'] / res['cached']:>8.2f}x")  # fmt: skip
    finally:
        for (m, a), k in zip(kernels, saved, strict=True):
            setattr(m, a, k)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536, 262144])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--sweep", action="store_true", help="pick launch configs at the middle size")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU debugging)")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument(
        "--host", action="store_true",
        help="only the wrappers' host time with kernel launches stubbed (cached vs uncached)",
    )  # fmt: skip
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = [64, 256] if args.quick else args.tokens
    record = {
        "benchmark": "store_load",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "command": "PYTHONPATH=. python3 " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "block_size": args.block_size,
        "results": [],
    }

    def save():
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)

    if args.host:
        n = 4096 if not args.quick else 256
        print(f"host us per call, kernel launches stubbed, {n} tokens")
        print(f"{'format':<31}{'op':<16}{'uncached':>10}{'cached':>10}{'gain':>9}")
        record["host_overhead"] = host_overhead(args.formats, n, args.block_size, device)
        save()
        return 0
    peak_bytes = 2 << 30 if device.type == "cuda" else 1 << 20
    record["copy_peak_gbps"] = peak_bytes / copy_time(peak_bytes, device) / 1e9
    print(f"{record['device']}: device-to-device copy {record['copy_peak_gbps']:.0f} GB/s")
    print(f"{'format':<31}{'op':<6}{'tokens':>7}{'triton GB/s':>12}{'torch GB/s':>11}"
          f"{'copy GB/s':>10}{'ratio':>7}{'vs torch':>9}{'graph':>7}{'host us':>9}")  # fmt: skip
    for name in args.formats:
        layout = FORMATS[name]
        configs = {"store": None, "load": None}
        if args.sweep and device.type == "cuda":
            mid = Case(layout, tokens[len(tokens) // 2], args.block_size, device)
            load_grid = CAST_SWEEP if layout.do_cast and layout.is_quantized else RAW_SWEEP
            for op, grid in (("store", STORE_SWEEP), ("load", load_grid)):
                configs[op], tried = sweep(mid, op, grid, device)
                record["results"].append({"format": name, "op": op, "sweep": tried,
                                          "best": configs[op]})  # fmt: skip
                print(f"  sweep {name} {op}: best {configs[op]}")
            del mid
        for n in tokens:
            case = Case(layout, n, args.block_size, device)
            for op in ("store", "load"):
                fn = functools.partial(getattr(case, op), configs[op])
                base = getattr(case, f"{op}_torch")
                nbytes = case.store_bytes if op == "store" else case.load_bytes
                t_tr = median_s(fn, device)
                # GPU time without host launch overhead: 20 calls replayed from one CUDA graph
                t_graph = graph_per_call_s(fn, device, calls=20) if device.type == "cuda" else t_tr
                t_host = host_per_call_s(fn, device)
                t_pt = median_s(base, device, reps=2)
                t_cp = copy_time(nbytes, device)
                row = {
                    "format": name, "op": op, "tokens": n, "bytes": nbytes,
                    "config": configs[op], "triton_s": t_tr, "torch_s": t_pt, "copy_s": t_cp,
                    "triton_gbps": nbytes / t_tr / 1e9, "torch_gbps": nbytes / t_pt / 1e9,
                    "copy_gbps": nbytes / t_cp / 1e9, "ratio_vs_copy": t_cp / t_tr,
                    "torch_ratio_vs_copy": t_cp / t_pt, "speedup_vs_torch": t_pt / t_tr,
                    "triton_graph_s": t_graph, "graph_gbps": nbytes / t_graph / 1e9,
                    "graph_ratio_vs_copy": t_cp / t_graph, "host_s": t_host,
                    "bit_exact_vs_torch": case.matches_torch(op, configs[op]),
                }  # fmt: skip
                record["results"].append(row)
                save()
                print(f"{name:<31}{op:<6}{n:>7}{row['triton_gbps']:>12.1f}"
                      f"{row['torch_gbps']:>11.1f}{row['copy_gbps']:>10.1f}"
                      f"{row['ratio_vs_copy']:>7.2f}{row['speedup_vs_torch']:>8.1f}x"
                      f"{row['graph_ratio_vs_copy']:>7.2f}{t_host * 1e6:>9.1f}"
                      f"{'' if row['bit_exact_vs_torch'] else '  MISMATCH'}")  # fmt: skip
            del case
        if device.type == "cuda":
            small = Case(layout, 256, args.block_size, device)
            dummy = torch.empty(1, device=device)
            t_empty = graph_per_call_s(functools.partial(_empty_kernel[(1,)], dummy), device)
            for op in ("store", "load"):
                t = graph_per_call_s(getattr(small, op), device)  # library defaults
                row = {
                    "format": name,
                    "op": op,
                    "tokens": 256,
                    "cuda_graph": True,
                    "per_call_s": t,
                    "empty_kernel_s": t_empty,
                    "vs_empty": t / t_empty,
                }
                record["results"].append(row)  # fmt: skip
                print(
                    f"{name:<31}{op:<6}{256:>7}  CUDA graph {t * 1e6:.2f} us/call, "
                    f"empty kernel {t_empty * 1e6:.2f} us ({t / t_empty:.2f}x)"
                )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
