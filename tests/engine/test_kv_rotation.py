"""Hadamard-rotated q/k (``kv_rotation``): H is orthonormal, the rotation leaves an exact
cache's logits unchanged while the cache holds ``k H``, and a quantized cache with the rotation
equals its dequantize-then-attend oracle (a bf16 cache whose store rounds the rotated K/V
through the format) on prefill, decode, prefix-cache hits and speculative decoding.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import make_gemma3_model

from kvplan import LLM, SamplingParams, quant
from kvplan.cache.kv_tensors import KVCacheTensors
from kvplan.engine.config import EngineConfig
from kvplan.engine.scoring import prompt_logits
from kvplan.models.config import named_config
from kvplan.models.kv_rotation import hadamard, hadamard_qk, rotate, supports_rotation

CFG = named_config("tiny-llama", head_dim_override=64, num_heads=4, num_kv_heads=2,
                   hidden_size=128)  # fmt: skip


def _engine(kv_format: str, model=CFG, **kw) -> LLM:
    kw = dict(device="cpu", backend="block_offsets", block_size=4, max_model_len=96,
              num_blocks=80, enable_prefix_caching=False) | kw  # fmt: skip
    return LLM(model, kv_format=kv_format, **kw)


def _prompts(n: int, seed: int, vocab: int = CFG.vocab_size) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_rot")
    make_gemma3_model(seed=3, window=12).save_pretrained(str(folder))
    return str(folder)


def test_hadamard_is_orthonormal_and_symmetric():
    for d in (1, 2, 4, 8, 16, 64, 128, 256):
        h = hadamard(d, torch.float64, torch.device("cpu"))
        assert h.shape == (d, d)
        torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.equal(h, h.T)
        i = torch.arange(d)
        signs = 1 - 2 * torch.tensor(  # Sylvester: H[i, j] = (-1)^popcount(i & j) / sqrt(d)
            [[bin(a & b).count("1") % 2 for b in i.tolist()] for a in i.tolist()]
        )
        torch.testing.assert_close(h * d**0.5, signs.double(), rtol=0, atol=1e-12)
    h32 = hadamard(64, torch.float32, torch.device("cpu"))
    assert h32.dtype == torch.float32 and hadamard(64, torch.float32, torch.device("cpu")) is h32
    assert not supports_rotation(48) and supports_rotation(64)
    with pytest.raises(ValueError, match="head_dim=48"):
        hadamard(48, torch.float32, torch.device("cpu"))


def test_rotation_keeps_scores_and_spreads_an_outlier():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 64, generator=g), torch.randn(7, 2, 64, generator=g)
    k[..., 3] *= 30.0  # an outlier channel
    qr, kr = hadamard_qk(q, k)
    scores = torch.einsum("thd,shd->ths", q[:, :2], k[:, :2].expand(7, 2, 64))
    rotated = torch.einsum("thd,shd->ths", qr[:, :2], kr[:, :2].expand(7, 2, 64))
    torch.testing.assert_close(rotated, scores, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rotate(kr), k, rtol=0, atol=1e-4)  # H H = I
    ratio = lambda x: float(x.abs().max() / x.pow(2).mean().sqrt())  # noqa: E731
    assert ratio(kr) < ratio(k) / 2


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_exact_cache_logits_unchanged_and_cache_holds_rotated_keys(which, gemma_folder):
    model = CFG if which == "llama" else gemma_folder
    plain, rot = (_engine("fp32", model, kv_rotation=r) for r in (False, True))
    vocab = plain.parts.config.vocab_size
    ids = _prompts(1, seed=5, vocab=vocab)[0] * 2
    want = prompt_logits(plain.engine, ids, 8)
    got = prompt_logits(rot.engine, ids, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    n = len(ids)  # the same blocks in the same order: the same slots hold the same tokens
    for layer in (0, plain.parts.config.num_layers - 1):
        k_plain = plain.parts.kv_cache.k_cache(layer).flatten(0, 1)[4 : 4 + n]  # block 0 = pad
        k_rot = rot.parts.kv_cache.k_cache(layer).flatten(0, 1)[4 : 4 + n]
        assert k_plain.abs().sum() > 0 and not torch.allclose(k_rot, k_plain, atol=1e-3)
        torch.testing.assert_close(k_rot, rotate(k_plain), rtol=1e-5, atol=1e-5)
        v_plain = plain.parts.kv_cache.v_cache(layer).flatten(0, 1)[4 : 4 + n]
        v_rot = rot.parts.kv_cache.v_cache(layer).flatten(0, 1)[4 : 4 + n]
        torch.testing.assert_close(v_rot, v_plain, rtol=1e-5, atol=1e-5)  # V is not rotated


def _oracle(kv_format: str, **kw) -> LLM:
    """A bf16 cache, q/k rotated, whose store rounds K/V through ``kv_format``'s layout."""
    layout = KVCacheTensors(1, 2, 4, CFG.num_kv_heads, CFG.head_dim, kv_format=kv_format).layout
    llm = _engine("bf16", kv_rotation=True, **kw)
    store = llm.parts.kv_cache.store

    def rounded(x):
        flat = x.to(torch.bfloat16).reshape(x.shape[0], -1)  # [T, Hkv * D]
        return quant.dequantize(*quant.quantize(flat, layout), layout).view(x.shape)

    def wrapped(layer, k, v, slot_mapping, *, check=True):
        return store(layer, rounded(k), rounded(v), slot_mapping, check=check)

    llm.parts.kv_cache.store = wrapped
    return llm


@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_quantized_rotated_logits_equal_oracle(kv_format):
    ids = _prompts(1, seed=2)[0] * 2
    got = prompt_logits(_engine(kv_format, kv_rotation=True).engine, ids, 8)
    want = prompt_logits(_oracle(kv_format).engine, ids, 8)
    assert torch.equal(got, want)
    unrotated = prompt_logits(_engine(kv_format).engine, ids, 8)
    assert not torch.equal(got, unrotated)  # the rotation changes what the format rounds


@pytest.mark.parametrize(
    "settings",
    [
        {"backend": "block_offsets", "max_num_batched_tokens": 32},
        {"backend": "ragged", "enable_prefix_caching": True},
        {"backend": "block_offsets", "num_speculative_tokens": 3},
    ],
    ids=["chunked", "prefix-cache", "speculative"],
)
def test_fp8_rotated_greedy_tokens_equal_oracle(settings):
    prompts = _prompts(4, seed=1)
    prompts += [prompts[0] + p for p in _prompts(2, seed=9)]  # shared prefixes
    prompts += [p[:6] * 4 for p in prompts[:2]]  # repetitive: n-gram drafts get accepted
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = _engine("fp8", kv_rotation=True, **settings)
    want = _oracle("fp8", **settings)
    outs = [[o.token_ids for o in llm.generate(prompts, params)] for llm in (got, want)]
    assert outs[0] == outs[1]
    if settings.get("enable_prefix_caching"):  # a second round hits the cached (rotated) keys
        again = [o.token_ids for o in got.generate(prompts, params)]
        assert again == outs[1]


def test_kv_rotation_setting_checks():
    with pytest.raises(TypeError, match="kv_rotation"):
        EngineConfig(kv_rotation=1)
    with pytest.raises(ValueError, match="kv_rotation=True is not supported"):
        EngineConfig(kv_rotation=True, tensor_parallel_size=2)
    cfg48 = named_config("tiny-llama", head_dim_override=48, num_heads=4, num_kv_heads=2,
                         hidden_size=128)  # fmt: skip
    with pytest.raises(ValueError, match="head_dim=48"):
        _engine("fp32", cfg48, kv_rotation=True)
    _engine("fp32", cfg48)  # off by default: any head_dim
