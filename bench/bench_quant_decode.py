"""Paged decode attention over bf16 vs fp8 / int8 / fp4 pages read in place: time per call and
KV bytes per second, with a sweep of the kernel's tiling (tile_n, num_warps, num_stages; with
``--prefetch 1,2`` each also with those whole-tile loop modes), then
of num_splits on each format's fastest tiling; prints each format's default and fastest launch
(all timed with ``check=False``).

Shapes: the dense engine's long workload by default (llama-1b heads: 32 query / 8 KV heads x
64; batch 32 x 8,192 context, block 16, shuffled page table; ``--batch`` / ``--context``).
Every quantized cache holds the engine's records (`kvplan.cache.kv_tensors.QUANTIZED_KV_FORMATS`,
`kvplan.quant.quantize`); every swept output is checked against the fp32 kernel over the
dequantized (bf16) values.

GPU:  PYTHONPATH=. python3 bench/bench_quant_decode.py --out q.json
CPU:  PYTHONPATH=. python3 bench/bench_quant_decode.py --quick   (interpreter, tiny sizes)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported

from bench_paged_attention import make_paged, rel_err, timed  # noqa: E402

import kvplan.ops._paged_attention_kernels as pak  # noqa: E402
from kvplan import quant  # noqa: E402
from kvplan.cache.kv_tensors import QUANTIZED_KV_FORMATS  # noqa: E402
from kvplan.formats import KVCacheFormat, alloc_kv_cache  # noqa: E402
from kvplan.ops.paged_attention import paged_attention_decode_triton  # noqa: E402


def quantized_pages(cache: torch.Tensor, kv_format: str):
    """bf16 ``[N, bs, H, D]`` -> (uint8 token-record cache, its layout, bf16 dequantized)."""
    n, bs, h, d = cache.shape
    dtype, group, sf = QUANTIZED_KV_FORMATS[kv_format]
    layout = KVCacheFormat(dtype, h * d, group, 0, True, sf, f"bench {kv_format}", True)
    raw = alloc_kv_cache(n, bs, layout, device=cache.device)
    flat = cache.reshape(n * bs, h * d)
    values, scales = quant.quantize(flat, layout)
    raw.view(n * bs, -1)[:, : values.shape[1] + scales.shape[1]] = torch.cat([values, scales], 1)
    back = quant.dequantize(values, scales, layout).view(n, bs, h, d)
    return raw, layout, back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--formats", default="bf16,fp8,int8,fp4")
    ap.add_argument("--tiles", default="32,64,128", help="tile_n values of the sweep")
    ap.add_argument("--warps", default="2,4,8", help="num_warps values of the sweep")
    ap.add_argument("--stages", default="2,3,5", help="num_stages values of the sweep")
    ap.add_argument(
        "--splits",
        default="1,2,4,8",
        help="num_splits values timed on each format's fastest tiling",
    )
    ap.add_argument("--no-tiling", action="store_true", help="skip the tiling sweep")
    ap.add_argument(
        "--with-splits",
        default="",
        help="also time every config (default, swept tilings, modes, caps) at each of these "
        "num_splits values (e.g. 2,4,8)",
    )
    ap.add_argument("--batch", type=int, default=32, help="sequences (GPU; default 32)")
    ap.add_argument(
        "--context",
        type=int,
        default=8192,
        help="keys per sequence (GPU; default 8,192; the short workload's decode: 320)",
    )
    ap.add_argument(
        "--prefetch",
        default="",
        help="also every tiling with each of these whole-tile loop modes, e.g. 1,2 "
        "(prefetch=, kvplan.ops._paged_attention_kernels.PREFETCH_MODES: 1 quantized bytes a "
        "tile ahead, 2 page lookups a tile ahead and V's scales on the probabilities)",
    )
    ap.add_argument(
        "--maxnreg",
        default="",
        help="also every tiling with each of these register caps (maxnreg=, e.g. 168,128)",
    )
    ap.add_argument(
        "--fp4-f16",
        action="store_true",
        help="also every fp4 config with the other tiles than the default (fp16 tiles when "
        "kvplan.ops._paged_attention_kernels.FP4_F16_TILES / KVPLAN_FP4_F16 is off, bf16 tiles "
        "when on)",
    )
    ap.add_argument(
        "--fp4-nibbles",
        action="store_true",
        help="also every fp4 config with the other order of the fp16 tiles than the default "
        "(in order when kvplan.ops._paged_attention_kernels.FP4_NIBBLE_TILES / "
        "KVPLAN_FP4_NIBBLES is on, nibble order when off)",
    )
    ap.add_argument(
        "--heads-first",
        action="store_true",
        help="also every config with the programs ordered KV head first (heads_first=True: a "
        "sequence's heads side by side; kvplan.ops._paged_attention_kernels.DECODE_HEADS_FIRST)",
    )
    ap.add_argument(
        "--heads",
        default="",
        help="also every config with each of these KV heads a program (heads=, e.g. 2,4: "
        "neighbouring heads read as one; kvplan.ops._paged_attention_kernels.decode_heads)",
    )
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time CUDA-graph replays of the calls (the engine's decode steps; eager calls of "
        "short contexts time the host)",
    )
    args = ap.parse_args()
    f16_default = pak.FP4_F16_TILES
    nib_default = pak.FP4_NIBBLE_TILES
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    shape = (args.batch, args.context, 8, 64, 32, 16) if cuda else (2, 40, 2, 32, 4, 8)
    batch, ctx, hkv, d, h, bs = shape
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    k, v, table, page_start, kv_lens = make_paged(batch, ctx, hkv, d, bs, torch.bfloat16, dev, gen)
    page_ids = table.flatten()
    q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
    reps, warm = (20, 3) if cuda else (1, 0)
    stages = tuple(int(x) for x in args.stages.split(","))
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    grid = itertools.product(ints(args.tiles), ints(args.warps), stages)
    sweep = list(grid) if cuda else [(16, 4, 2)]
    if args.no_tiling:
        sweep = []
    rows = []
    for fmt in args.formats.split(","):
        if fmt == "bf16":
            caches, layout, ref_caches = (k, v), None, (k, v)
            per_value = 2.0
        else:
            (kr, layout, kd), (vr, _, vd) = (quantized_pages(t, fmt) for t in (k, v))
            caches, ref_caches = (kr, vr), (kd, vd)
            per_value = kr[0, 0, 0].numel() / (hkv * d)  # record bytes per value
        want = paged_attention_decode_triton(  # fp32 products of the same (bf16) values
            q.float(),
            *(c.float() for c in ref_caches),
            page_ids,
            page_start,
            kv_lens,
            scale=d**-0.5,
        ).to(q.dtype)
        kv_bytes = 2 * batch * ctx * hkv * d * per_value
        tilings = [dict(tile_n=t, num_warps=w, num_stages=st) for t, w, st in sweep]
        modes = [m for m in ints(args.prefetch) if fmt != "bf16" or m != 1]  # 1: quantized
        if modes:  # each mode and 0, whatever the format's default
            tilings = [{**t, "prefetch": m} for t in [{}, *tilings] for m in (0, *modes)]
        if args.maxnreg:  # each cap, and the compiler's own choice (0)
            caps = (0, *ints(args.maxnreg))
            tilings = [{**t, "maxnreg": c} for t in [{}, *tilings] for c in caps]
        if args.fp4_f16 and fmt == "fp4":  # each config also with the other tiles
            tilings += [{**t, "fp4_f16": not f16_default} for t in [{}, *tilings]]
        if args.fp4_nibbles and fmt == "fp4":  # each fp16-tile config also in the other order
            tilings += [{**t, "fp4_nib": not nib_default} for t in [{}, *tilings]
                        if t.get("fp4_f16", f16_default)]  # fmt: skip
        if args.heads:  # every config above (and the default) with these heads a program
            tilings += [{**t, "heads": n} for t in [{}, *tilings] for n in ints(args.heads)]
        if args.heads_first:  # every config above (and the default) in the other order
            tilings += [{**t, "heads_first": True} for t in [{}, *tilings]]
        if args.with_splits:  # every config above (and the default) at these split counts
            n_splits = ints(args.with_splits)
            tilings += [{**t, "num_splits": n} for t in [{}, *tilings] for n in n_splits]

        def measure(kw, caches=caches, layout=layout, want=want, kv_bytes=kv_bytes, fmt=fmt):
            launch = {k: x for k, x in kw.items() if k not in ("fp4_f16", "fp4_nib")}

            def call():
                pak.FP4_F16_TILES = kw.get("fp4_f16", f16_default)  # read at launch
                pak.FP4_NIBBLE_TILES = kw.get("fp4_nib", nib_default)
                return paged_attention_decode_triton(
                    q, *caches, page_ids, page_start, kv_lens, scale=d**-0.5, kv_layout=layout,
                    max_kv_len=ctx, check=False, **launch,
                )  # fmt: skip

            try:
                err = rel_err(call(), want)
                sec = timed(call, reps, warm, graph=args.graph and cuda)
            except Exception as exc:  # a config the compiler rejects (shared memory)
                rows.append({"format": fmt, "config": kw or "default", "error": repr(exc)[:200]})
                return
            rows.append({"format": fmt, "config": kw or "default", "us": sec * 1e6,
                         "GBps": kv_bytes / sec / 1e9, "rel_err": err})  # fmt: skip
            print(f"  {fmt} {kw or 'default'}: {sec * 1e6:.1f} us", flush=True)

        for kw in [{}, *tilings]:
            measure(kw)
        # num_splits on the fastest tiling (the default split count keeps ~2 programs per SM)
        timed_rows = [r for r in rows if r["format"] == fmt and "us" in r]
        if cuda and timed_rows and args.splits:
            best = min(timed_rows, key=lambda r: r["us"])["config"]
            best = {} if best == "default" else best
            for n in ints(args.splits):
                measure({**best, "num_splits": n})
    print(f"{'format':>6} {'config':>34} {'us':>9} {'GB/s':>8} {'rel err':>9}")
    for fmt in args.formats.split(","):
        mine = [r for r in rows if r["format"] == fmt and "us" in r]
        best = min(mine, key=lambda r: r["us"], default=None)
        for r in [x for x in mine if x["config"] == "default"] + ([best] if best else []):
            print(f"{fmt:>6} {str(r['config']):>34} {r['us']:9.1f} {r['GBps']:8.0f} "
                  f"{r['rel_err']:9.2e}")  # fmt: skip
    record = {
        "bench": "quant_decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "shape": dict(batch=batch, context=ctx, kv_heads=hkv, head_dim=d, heads=h, block=bs),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.1f}s")
