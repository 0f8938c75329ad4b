"""Few-row projections as split-K partials added up by the norm after them.

A decode step's narrow projections (llama-1b's o and down at batch 64: 6-17 us for 8-34 MB of
weights) run below the bandwidth their bytes allow: cuBLAS gives them few programs, or splits K
and launches a reduction kernel of its own. `kvplan.models.fused.split_linear` asks for the
split as one batched GEMM with fp32 output, and the residual-add RMSNorm that follows anyway
adds the partials (`rms_norm` of a `SplitSums`), so no kernel is added.

For each ``M x N x K`` (rows x weight rows x input width, bf16) and each variant, a CUDA graph
runs the GEMM (and, in the "pair" column, the kernel after it: `rms_norm` with the residual,
or for qkv the qkv epilogue) over enough weight copies to exceed the L2 cache, as a decode
step streams its weights; a call's time is the replay's over the copies (median of
``--reps``). Variants: ``linear`` (``F.linear``) and ``split S`` (`split_linear`, the consumer
adding the partials). A shape named ``gemm`` has no consumer: its pair is the partials'
in-order total in torch (a bare GEMM, e.g. the hybrid bench model's expert gate/up). Each
split's output is compared with the linear one (largest relative
difference in bf16 ulps of 2^-8; whether the residual stream came out equal).

Usage::

    PYTHONPATH=. python3 bench/bench_split_linear.py --out $OUT/split_linear.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_small_gemm import (  # bench/: the script's directory
    graph_time,
    parse_shape,
    save_rows,
    streamed_weights,
)

from kvplan.models import fused

# llama-1b's o (2,048 x 2,048), down (2,048 x 8,192) and qkv (3,072 x 2,048) at several decode
# batches (qkv's pair: the qkv epilogue, without the cache store)
DEFAULT_SHAPES = tuple(
    f"{m},{n},{k},{name}"
    for name, n, k in (("o", 2048, 2048), ("down", 2048, 8192), ("qkv", 3072, 2048))
    for m in (16, 32, 64, 128, 256)
)


def measure(dev, gen, m, n, k, name, splits, args) -> list[dict]:
    """The rows of one shape: every variant's GEMM alone and GEMM + norm, and its agreement."""
    wbytes = n * k * 2
    ws = streamed_weights(n, k, args.weight_mb, dev, gen, scale=k**-0.5)
    copies = len(ws)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
    res0 = torch.randn(m, n, device=dev, generator=gen).to(torch.bfloat16)
    res = res0.clone()

    pos = torch.randint(0, 4096, (m,), device=dev, generator=gen)
    ang = torch.rand(4096, 32, device=dev, generator=gen) * 6.28
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))

    def consumer(y):  # what reads the projection next: the qkv epilogue or the add+norm
        if name == "gemm":  # no consumer of its own: the partials' total in torch
            return y.total() if isinstance(y, fused.SplitSums) else y
        if name == "qkv":  # llama-1b's heads: 32 q, 8 kv, head_dim 64
            return fused.qkv_epilogue_triton(y, pos, cos, sin, num_heads=32, num_kv_heads=8)[0]
        return fused.rms_norm_triton(y, nw, 1e-5, res)

    def linear(w, norm):
        y = F.linear(x, w)
        return consumer(y) if norm else y

    def split(w, norm, s):
        y = fused.split_linear(x, w, s)
        return consumer(y) if norm else y

    ref_res = res0.clone()
    res.copy_(res0)
    ref = consumer(F.linear(x, ws[0]))
    ref_res.copy_(res)
    variants = [("linear", linear)]
    variants += [(f"split {s}", lambda w, norm, s=s: split(w, norm, s))
                 for s in splits if k % s == 0]  # fmt: skip
    rows, base_pair = [], None
    for label, fn in variants:
        res.copy_(res0)
        out = fn(ws[0], True)
        # the norm's output against the linear path's, in bf16 ulps (2^-8 relative)
        ulp = ((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
               / 2**-8).max().item()  # fmt: skip
        res_same = torch.equal(res, ref_res)
        gemm = graph_time([lambda w=w, fn=fn: fn(w, False) for w in ws], args.reps) / copies
        pair = graph_time([lambda w=w, fn=fn: fn(w, True) for w in ws], args.reps) / copies
        base_pair = base_pair or pair
        rows.append({"name": name, "m": m, "n": n, "k": k, "variant": label,
                     "gemm_us": gemm * 1e6, "pair_us": pair * 1e6,
                     "pair_vs_linear": pair / base_pair, "max_ulp": ulp,
                     "residual_equal": res_same})  # fmt: skip
        print(f"{name + f' {m}x{n}x{k}':>20} {label:>8} {gemm * 1e6:8.2f} "
              f"{wbytes / gemm / 1e9:6.0f} {pair * 1e6:8.2f} {pair / base_pair:11.3f}  "
              f"{ulp:.1f}{'' if res_same else ' (residual differs)'}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES))
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--weight-mb", type=float, default=256.0, help="weights streamed a replay")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_split_linear needs a CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    splits = [int(s) for s in args.splits.split(",")]
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}")
    print(f"{'shape':>20} {'variant':>8} {'gemm us':>8} {'GB/s':>6} {'pair us':>8} "
          f"{'pair/linear':>11}  max diff (ulp)")  # fmt: skip
    for spec in args.shapes:
        m, n, k, name = parse_shape(spec)
        rows += measure(dev, gen, m, n, k, name, splits, args)
        torch.cuda.empty_cache()
    if args.out:
        save_rows(args.out, dev, rows)


if __name__ == "__main__":
    main()
