"""KV-format quality of DeepSeek-V4 on the planned hybrid family: fp8 / fp4 caches vs exact rows.

A random DeepSeek-V4 (kvplan's model, `init_random`) reads one random token sequence teacher-
forced through `PlannedHybridFamily` (chunked prefill), once per KV format; every position's
logits of a quantized run are compared with the exact run's:

* top-1 agreement: fraction of positions whose argmax equals the exact run's;
* relative logit error per position: ``||l_q - l_exact||_2 / ||l_exact||_2`` (mean and max);
* mean KL(exact || quantized) of the softmax distributions.

The default model has the real row widths: K=V rows of 512 (64 rotary dims) and indexer keys
of 128, so the main rows are exactly ``V41_FORMAT`` / ``V41_FP4_FORMAT`` and the indexer keys
exactly the three index formats. Usage::

    PYTHONPATH=. python3 bench/dsv4_kv_quality.py --out bench/results/dsv4_kv_quality.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys

import torch
import transformers as tf

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random

FORMATS = [
    ("fp8", "mxfp8"),
    ("fp8", "fp8_fp32sf"),
    ("fp8", "fp4"),
    ("fp4", "fp4"),
    ("fp4", "mxfp8"),
]


def make_model(args) -> DeepseekV4ForCausalLM:
    kinds = ["sliding_attention", "compressed_sparse_attention",
             "heavily_compressed_attention", "compressed_sparse_attention"]  # fmt: skip
    hf = tf.DeepseekV4Config(
        vocab_size=args.vocab, hidden_size=args.hidden, moe_intermediate_size=128,
        num_hidden_layers=len(kinds), num_attention_heads=4, head_dim=args.head_dim,
        q_lora_rank=128, num_experts_per_tok=2, n_routed_experts=4, layer_types=kinds,
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(kinds) - 1),
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": args.hca_ratio},
        sliding_window=args.window, o_groups=2, o_lora_rank=64, index_n_heads=8,
        index_head_dim=args.index_head_dim, index_topk=args.top_k, hc_mult=2,
        partial_rotary_factor=64 / args.head_dim, max_position_embeddings=4 * args.seq_len,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf)).eval()
    return init_random(model, seed=args.seed, std=args.std)


@torch.no_grad()
def teacher_forced(model, ids: list[int], kv_format: str, index_format: str | None, args):
    """fp32 logits ``[S, V]`` of every position, prefilled in chunks of ``args.chunk``."""
    block = math.lcm(16, 4, args.hca_ratio)
    fam = PlannedHybridFamily(
        model.config.layer_specs(), block_size=block, num_blocks=2 + len(ids) // block,
        num_state_slots=1, max_model_len=len(ids), kv_format=kv_format,
        index_format=index_format,
    )  # fmt: skip
    table = list(range(1, 2 + len(ids) // block))
    out = []
    for start in range(0, len(ids), args.chunk):
        n = min(args.chunk, len(ids) - start)
        pos = torch.arange(start, start + n)
        ctx = fam.plan([HybridSeq(0, start, n, ids, table, 0)], pos)
        out.append(model(torch.tensor(ids[start : start + n]), pos, ctx))
    return torch.cat(out)


def compare(exact: torch.Tensor, got: torch.Tensor) -> dict:
    rel = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    logp, logq = exact.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return {
        "top1": float((got.argmax(-1) == exact.argmax(-1)).float().mean()),
        "rel_err_mean": float(rel.mean()),
        "rel_err_max": float(rel.max()),
        "kl_mean": float(kl.mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=96)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--index-head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--hca-ratio", type=int, default=16)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--std", type=float, default=0.02, help="init_random's weight std")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default=None, help="append one JSON row per format here")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in args.seeds:
        args.seed = seed
        model = make_model(args)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, args.vocab, (args.seq_len,), generator=gen).tolist()
        exact = teacher_forced(model, ids, "exact", None, args)
        for kv_format, index_format in FORMATS:
            got = teacher_forced(model, ids, kv_format, index_format, args)
            rows.append({"seed": seed, "kv_format": kv_format, "index_format": index_format,
                         **compare(exact, got)})  # fmt: skip
    print("| kv_format | index keys | top-1 vs exact | rel. logit error mean / max | KL mean |")
    print("|---|---|---|---|---|")
    for kv_format, index_format in FORMATS:
        sel = [r for r in rows if (r["kv_format"], r["index_format"]) == (kv_format, index_format)]
        top1 = sum(r["top1"] for r in sel) / len(sel)
        mean = sum(r["rel_err_mean"] for r in sel) / len(sel)
        worst = max(r["rel_err_max"] for r in sel)
        kl = sum(r["kl_mean"] for r in sel) / len(sel)
        print(f"| {kv_format} | {index_format} | {top1:.4f} | {mean:.4f} / {worst:.4f} "
              f"| {kl:.2e} |")  # fmt: skip
    if args.out:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": f"cpu ({platform.processor() or platform.machine()})",
            "command": " ".join(["python3"] + sys.argv),
            "torch": torch.__version__,
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "seed")},
        }
        with open(args.out, "a") as f:
            f.write(json.dumps({**meta, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
