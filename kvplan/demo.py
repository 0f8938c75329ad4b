"""``kvplan kv-demo``: store -> load round trip of every KV cache format.

For each supported format (and BF16) it allocates a paged cache on the chosen device, stores
random BF16 K/V through a shuffled block table, loads it back through a block load plan and
prints bytes per token, compression against BF16, the error against the BF16 input and the
store/load throughput (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvplan import quant
from kvplan.formats import SUPPORTED_KV_CACHE_FORMATS, KVCacheFormat, alloc_kv_cache, bf16_format
from kvplan.load_plan import BlockLoadPlanBuilder
from kvplan.ops.load import LoadedIndexKV, load_paged_kv_cache
from kvplan.ops.store import store_kv_cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--num-tokens", type=int, default=None, help="default 4096 (CPU: 512)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (CPU: 1)")
    parser.add_argument("--seed", type=int, default=0)


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def round_trip(
    layout: KVCacheFormat,
    num_tokens: int,
    block_size: int,
    device: torch.device,
    repeats: int = 1,
    seed: int = 0,
) -> dict[str, float]:
    """Store ``num_tokens`` random rows, load them back; return error and throughput figures."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 1
    cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
    kv = torch.randn(num_tokens, layout.elements, generator=g).bfloat16().to(device)
    table = torch.randperm(num_blocks, generator=g)[: num_blocks - 1]  # [blocks of the sequence]
    positions = torch.arange(num_tokens)
    slots = table[positions // block_size] * block_size + positions % block_size
    slots = slots.to(torch.int32).to(device)
    builder = BlockLoadPlanBuilder(block_size)
    builder.append_paged_range(table.tolist(), 0, num_tokens)
    segments, total_k = builder.build(device)

    store_s = _timed(lambda: store_kv_cache(kv, cache, slots, layout=layout, check=False),
                     repeats, device)  # fmt: skip
    out = load_paged_kv_cache(cache, segments, total_k, layout=layout)
    load_s = _timed(
        lambda: load_paged_kv_cache(cache, segments, total_k, out, layout=layout, check=False),
        repeats,
        device,
    )
    if isinstance(out, LoadedIndexKV):
        values = out.values.view(torch.uint8).reshape(total_k, -1)
        scales = out.scales.view(torch.uint8).reshape(total_k, -1)[:, : layout.sf_bytes]
        loaded = quant.dequantize(values, scales, layout)
        out_bytes = values.shape[1] + out.scales.view(torch.uint8).reshape(total_k, -1).shape[1]
    else:
        loaded = out
        out_bytes = 2 * layout.elements
    err = (loaded.float() - kv.float()).abs()
    in_bytes = 2 * layout.elements
    bpt = layout.bytes_per_token
    return {
        "bytes_per_token": bpt,
        "compression": 2 * layout.elements / bpt,
        "max_err": float(err.max()),
        "mean_err": float(err.mean()),
        "store_gbps": num_tokens * (in_bytes + bpt) / store_s / 1e9,
        "load_gbps": num_tokens * (bpt + out_bytes) / load_s / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    num_tokens = args.num_tokens or (4096 if on_gpu else 512)
    repeats = args.repeats or (20 if on_gpu else 1)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"kv-demo: {num_tokens} tokens, block_size {args.block_size}, device {name}")
    header = (
        f"{'format':<44} {'B/token':>7} {'vs BF16':>7} {'max err':>9} {'mean err':>9} "
        f"{'store GB/s':>10} {'load GB/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for layout in (*SUPPORTED_KV_CACHE_FORMATS, bf16_format(512)):
        r = round_trip(layout, num_tokens, args.block_size, device, repeats, args.seed)
        print(
            f"{layout.note:<44} {r['bytes_per_token']:>7d} {r['compression']:>6.2f}x "
            f"{r['max_err']:>9.4f} {r['mean_err']:>9.5f} {r['store_gbps']:>10.3g} "
            f"{r['load_gbps']:>9.3g}"
        )
    return 0
