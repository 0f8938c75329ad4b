"""Quality of the engine's fp8 KV format against the previous UE8M0 rule (CPU, seconds).

Teacher-forced logits of a random tiny Llama through ``prompt_logits``: fp8 keeps a loose
top-1 agreement with the fp32 cache, and it is at least as close to fp32 as the same engine
whose K/V are rounded through the UE8M0-per-32 rule (the format ``fp8`` used before).
"""

from __future__ import annotations

import torch

from kvplan import LLM, quant
from kvplan.engine.scoring import compare_logits, prompt_logits
from kvplan.formats import KVCacheFormat
from kvplan.models.config import named_config


def _engine(kv_format: str) -> LLM:
    return LLM(
        named_config("tiny-llama", head_dim_override=64),  # head_dim: whole scale groups
        device="cpu",
        kv_format=kv_format,
        max_model_len=256,
        num_blocks=20,
        enable_prefix_caching=False,
    )


def _ue8m0_store(kv_cache):
    """Round K/V through e4m3 + UE8M0 per 32 (bf16 in, bf16 out) before an fp32 store."""
    hd = kv_cache.num_kv_heads * kv_cache.head_dim
    old = KVCacheFormat("e4m3", hd, 32, 0, True, "ue8m0", "old fp8", True)
    store = kv_cache.store

    def rounded(x):
        flat = x.to(torch.bfloat16).reshape(x.shape[0], -1)
        return quant.dequantize(*quant.quantize(flat, old), old).view(x.shape)

    def wrapped(layer, k, v, slot_mapping, *, check=True):
        return store(layer, rounded(k), rounded(v), slot_mapping, check=check)

    return wrapped


def test_fp8_agreement_not_worse_than_ue8m0():
    ref_llm = _engine("fp32")
    vocab = ref_llm.parts.config.vocab_size
    ids = torch.randint(0, vocab, (192,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = prompt_logits(ref_llm.engine, ids, 64)
    fp8 = compare_logits(prompt_logits(_engine("fp8").engine, ids, 64), ref)
    old_llm = _engine("fp32")
    old_llm.parts.kv_cache.store = _ue8m0_store(old_llm.parts.kv_cache)
    old = compare_logits(prompt_logits(old_llm.engine, ids, 64), ref)
    print(f"\nfp8 {fp8}\nue8m0 {old}")
    assert fp8.top1_agreement > 0.9
    assert fp8.top1_agreement >= old.top1_agreement
    assert fp8.rel_rms_error < old.rel_rms_error


def test_fp8_stores_each_group_max_exactly():
    from kvplan.cache.kv_tensors import KVCacheTensors

    g = torch.Generator().manual_seed(4)
    kv = KVCacheTensors(1, 3, 4, 2, 64, kv_format="fp8")
    k = torch.randn(4, 2, 64, generator=g) * torch.logspace(-2, 2, 64)  # outlier channels
    kv.store(0, k, k, torch.arange(4, 8))
    read, _ = kv.read_blocks(0, torch.tensor([1]))  # [1, 4, 2, 64]
    groups = k.to(torch.bfloat16).float().view(4, 2, 2, 32)
    got = read[0].float().view(4, 2, 2, 32)
    idx = groups.abs().argmax(-1, keepdim=True)
    assert torch.equal(got.gather(-1, idx), groups.gather(-1, idx))
