"""Count the GEMMs of one DeepSeek-V4 decode step per layer kind (CPU, a dispatch mode).

A tiny random model (one layer of each kind: sliding, CSA, HCA) on the reference hybrid family
reads a prompt, then takes one decode step of ``--batch`` sequences with the MoE on its dense
(CUDA-graph) path. Every ``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` of the step is
attributed to the layer running it and sorted by the Python frames that issued it:

* ``gemm``   -- the model's own projections (cuBLAS launches on CUDA);
* ``triton`` -- torch paths of ops that are Triton kernels on CUDA (hyper-connections, the MoE
  weighted sum), so not GEMM launches there;
* ``attend`` -- the reference family's attention (a different backend on CUDA).

    PYTHONPATH=. python bench/dsv4_gemm_count.py [--batch 4]

Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from kvplan.models.deepseek_v4.moe import graph_safe_routing

GEMMS = ("mm", "addmm", "bmm", "baddbmm")
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
TRITON_ON_CUDA = ("ops/hyper_connection.py", "ops/moe_dense.py")


def tiny_config() -> DeepseekV4Config:
    import transformers as tf

    hf = tf.DeepseekV4Config(
        vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2,
        n_routed_experts=4, layer_types=list(KINDS), mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8,
        index_topk=2, hc_mult=2, hc_sinkhorn_iters=3, partial_rotary_factor=0.5,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return DeepseekV4Config.from_hf(hf.to_dict())


class _GemmLog(TorchDispatchMode):
    """Counts GEMM ops by (layer label, part)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = "outside layers"
        self.counts: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            files = [f.filename.replace("\\", "/") for f in traceback.extract_stack()]
            if any(f.endswith("backends/hybrid/reference.py") for f in files):
                part = "attend"
            elif any(f.endswith(t) for f in files for t in TRITON_ON_CUDA):
                part = "triton"
            else:
                part = "gemm"
            self.counts.setdefault(self.layer, Counter())[part] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def count(batch: int) -> dict[str, dict[str, int]]:
    """``{layer kind: {"gemm", "triton", "attend"}}`` GEMM counts of one decode step."""
    cfg = tiny_config()
    model = init_random(DeepseekV4ForCausalLM(cfg), seed=0, std=0.1).eval()
    family = ReferenceHybridFamily(cfg.layer_specs())
    prompt = 9
    ids = [[(7 * s + 3 * i) % cfg.vocab_size for i in range(prompt + 1)] for s in range(batch)]
    seqs = [HybridSeq(s, 0, prompt, ids[s], (), 0) for s in range(batch)]
    pos = torch.arange(prompt).repeat(batch)
    model(torch.tensor([t for s in ids for t in s[:prompt]]), pos, family.plan(seqs, pos))
    seqs = [HybridSeq(s, prompt, 1, ids[s], (), 0) for s in range(batch)]
    pos = torch.full((batch,), prompt, dtype=torch.int64)
    ctx = family.plan(seqs, pos)
    log = _GemmLog()
    handles = []
    for i, layer in enumerate(model.layers):

        def enter(mod, args, kind=cfg.layer_types[i]):
            log.layer = kind

        def leave(mod, args, out):
            log.layer = "outside layers"

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        with graph_safe_routing(model), log:
            model(torch.tensor([s[prompt] for s in ids]), pos, ctx)
    finally:
        for h in handles:
            h.remove()
    parts = ("gemm", "triton", "attend")
    return {
        k: {p: log.counts.get(k, Counter())[p] for p in parts} for k in (*KINDS, "outside layers")
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    res = count(args.batch)
    print(f"{'layer kind':30s} {'gemm':>5s} {'triton':>7s} {'attend':>7s}")
    for kind, c in res.items():
        print(f"{kind:30s} {c['gemm']:5d} {c['triton']:7d} {c['attend']:7d}")
    print(json.dumps({"bench": "dsv4_gemm_count", "batch": args.batch, "counts": res}))


if __name__ == "__main__":
    main()
