"""One decode launch per KV format for Nsight Compute: the dense paged decode kernel over bf16
vs fp8 / int8 / fp4 pages (the long workload's shape: batch 32 x 8,192 context, llama-1b's 32
query / 8 KV heads x 64, 16-token blocks), each format's default launch, so ``ncu`` can say
what bounds each (DRAM throughput, warp stall reasons, pipe use, occupancy).

    ncu --clock-control none -k regex:_decode_kernel --set full \\
        python3 bench/ncu_decode.py [--formats bf16,fp8] [--batch 32 --context 8192]

Each format runs one warm-up launch (compilation) and one more; outside ncu it prints the
median time of 20 CUDA-graph replays per format, for comparison with the profiled figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_paged_attention import make_paged, timed  # noqa: E402
from bench_quant_decode import quantized_pages  # noqa: E402

from kvplan.ops.paged_attention import paged_attention_decode_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,int8,fp4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--time", action="store_true", help="also time graph replays")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode.py needs a CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    batch, ctx, hkv, d, h, bs = args.batch, args.context, 8, 64, 32, 16
    k, v, table, page_start, kv_lens = make_paged(batch, ctx, hkv, d, bs, torch.bfloat16, dev, gen)
    q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
    for fmt in args.formats.split(","):
        if fmt == "bf16":
            caches, layout = (k, v), None
        else:
            (kr, layout, _), (vr, _, _) = (quantized_pages(t, fmt) for t in (k, v))
            caches = (kr, vr)

        def call(caches=caches, layout=layout):
            return paged_attention_decode_triton(
                q, *caches, table.flatten(), page_start, kv_lens, scale=d**-0.5,
                kv_layout=layout, max_kv_len=ctx, check=False,
            )  # fmt: skip

        call()
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
        if args.time:
            print(f"{fmt}: {timed(call, 20, 3, graph=True) * 1e6:.1f} us (graph replays)")


if __name__ == "__main__":
    main()
