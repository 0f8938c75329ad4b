"""Shared builders for the DeepSeek-V4 tests: tiny random HF models, save / load, step drivers.

* `hf_config(seed, **overrides)` -- a tiny random ``transformers.DeepseekV4Config``;
* `hf_model(cfg, seed)` -- HF's model with every parameter randomised (HF starts sinks,
  position biases, the routers' correction bias and ``tid2eid`` at zero);
* `saved_pair(tmp_path, seed)` -- (HF model, kvplan model loaded from its ``save_pretrained``);
* `saved_folder(seed, folder)` -- (HF model of a config with all three layer kinds, the
  folder its ``save_pretrained`` wrote), for engine tests;
* `hf_greedy(hf, prompt, n)` -- HF ``generate``'s ``n`` greedy tokens after one prompt;
* `run_steps(model, family, schedule)` -- drive the kvplan model through flat steps;
* `hf_logits(hf, ids)` -- HF's full-forward fp32 logits ``[S, V]`` of one sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers as tf

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.models.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def hf_config(seed: int, **overrides) -> tf.DeepseekV4Config:
    """A tiny random config: 3-4 layers mixing all three kinds (in a seed-dependent order),
    window 5-8, CSA ratio 4, HCA ratio 8 or 16, top-k 2-3, 8 indexer heads, 4 experts."""
    rng = random.Random(seed)
    num_layers = rng.choice((3, 4))
    kinds = list(KINDS) + [rng.choice(KINDS)] * (num_layers - 3)
    rng.shuffle(kinds)
    num_hash = rng.choice((1, 2))
    mlp = ["hash_moe" if i < num_hash else "moe" for i in range(num_layers)]
    kw = dict(
        vocab_size=96,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        num_experts_per_tok=2,
        n_routed_experts=4,
        layer_types=kinds,
        mlp_layer_types=mlp,
        compress_rates={
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": rng.choice((8, 16)),
        },
        sliding_window=rng.choice((5, 6, 8)),
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=8,
        index_topk=rng.choice((2, 3)),
        hc_mult=rng.choice((2, 3)),
        hc_sinkhorn_iters=rng.choice((3, 20)),
        partial_rotary_factor=0.5,
        scoring_func=rng.choice(("sqrtsoftplus", "sigmoid")),
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return tf.DeepseekV4Config(**kw)


@torch.no_grad()
def hf_model(cfg: tf.DeepseekV4Config, seed: int) -> tf.DeepseekV4ForCausalLM:
    """HF's model in fp32 eval mode with random sinks, position biases, hyper-connection
    bases / scales, norms, correction biases and ``tid2eid`` (distinct experts per row)."""
    torch.manual_seed(seed)
    model = tf.DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sinks":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif leaf == "position_bias":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith("norm.weight") or leaf in ("scale", "hc_scale"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif leaf in ("base", "hc_base"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        elif name.endswith("tid2eid"):
            keys = torch.rand((b.shape[0], cfg.n_routed_experts), generator=gen)
            b.copy_(keys.argsort(dim=-1)[:, : b.shape[1]])
    return model


def saved_pair(
    tmp_path: Path, seed: int, **overrides
) -> tuple[tf.DeepseekV4ForCausalLM, DeepseekV4ForCausalLM]:
    """(HF model, kvplan model loaded from the folder HF's ``save_pretrained`` wrote)."""
    hf = hf_model(hf_config(seed, **overrides), seed)
    folder = tmp_path / f"dsv4_{seed}"
    hf.save_pretrained(folder)
    return hf, load_deepseek_v4(folder, torch.float32, "cpu")


@torch.no_grad()
def hf_logits(hf: tf.DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """HF's full forward over one sequence: fp32 logits ``[S, V]``."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def run_step(
    model: DeepseekV4ForCausalLM, family, rows: list[tuple[int, list[int], int, int]]
) -> tuple[list[torch.Tensor], object]:
    """One flat step over ``rows`` = (request_id, token_ids, q_start, seqlen_q) on the
    model's device; returns each sequence's logits ``[seqlen_q, V]`` and the step's context."""
    dev = next(model.parameters()).device
    seqs, ids, pos = [], [], []
    for rid, tokens, q_start, n in rows:
        seqs.append(HybridSeq(rid, q_start, n, tokens, (), 0))
        ids += tokens[q_start : q_start + n]
        pos += range(q_start, q_start + n)
    positions = torch.tensor(pos, dtype=torch.int64, device=dev)
    ctx = family.plan(seqs, positions)
    logits = model(torch.tensor(ids, dtype=torch.int64, device=dev), positions, ctx)
    return list(logits.split([n for *_, n in rows])), ctx


def random_tokens(seed: int, n: int, vocab: int = 96) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def saved_folder(seed: int, folder: Path) -> tuple[tf.DeepseekV4ForCausalLM, str]:
    """HF's random model of ``hf_config(seed)`` saved into ``folder``; the config must mix
    every kind of layer (the ring, HCA's entries, CSA's overlap state and indexer)."""
    cfg = hf_config(seed)
    assert len(set(cfg.layer_types)) == 3
    hf = hf_model(cfg, seed)
    hf.save_pretrained(folder)
    return hf, str(folder)


@torch.no_grad()
def hf_greedy(hf: tf.DeepseekV4ForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens HF's greedy ``generate`` appends to ``prompt`` (exactly ``n``)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()
