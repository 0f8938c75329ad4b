"""Greedy output equals Hugging Face transformers ``generate()`` token for token (CPU, fp32).

Random-weight Llama (GQA), Llama 3 (llama3 RoPE, tied embeddings), Qwen2 (qkv bias), Qwen3
(q/k norm) and Mistral (sliding window 12, shorter than the sequences) configs, 8 prompts x 64
new tokens, for every backend, with chunked prefill forced on (a 16-token budget, so prompts
are split and mixed with decode rows) and off, and with prefix reuse.
"""

from __future__ import annotations

from functools import partial

import pytest
from hf_models import hf_greedy, make_hf_model, random_prompts

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.backends import BACKEND_NAMES

# CPU fp32 semantics (token equality with HF fp32) even where CUDA is present
LLM = partial(_LLM, device="cpu")

FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> (model folder, prompts, HF greedy continuations), built lazily."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            hf = make_hf_model(family, seed=FAMILIES.index(family))
            folder = tmp_path_factory.mktemp(family)
            hf.save_pretrained(str(folder))
            prompts = random_prompts(8, 1, 40, hf.config.vocab_size, seed=7)
            cache[family] = (folder, prompts, hf_greedy(hf, prompts, NEW_TOKENS), hf)
        return cache[family]

    return get


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf(reference, family, backend, chunked):
    folder, prompts, expected, _ = reference(family)
    llm = LLM(
        str(folder),
        backend=backend,
        block_size=8,
        max_num_batched_tokens=16 if chunked else 64,
        enable_chunked_prefill=chunked,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_prefix_reuse_matches_hf(reference, family, backend):
    folder, _, _, hf = reference(family)
    shared = random_prompts(1, 29, 29, 256, seed=3)[0]  # 3 full blocks of 8 + 5 tokens
    tails = random_prompts(4, 1, 9, 256, seed=4)
    prompts = [shared + t for t in tails]
    expected = hf_greedy(hf, prompts, 24)
    llm = LLM(
        str(folder), backend=backend, block_size=8, max_num_batched_tokens=24, max_model_len=128
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = llm.generate(prompts[:1], params)[0]
    rest = llm.generate(prompts[1:], params)
    assert first.num_cached_prefix_tokens == 0
    assert [o.num_cached_prefix_tokens for o in rest] == [24, 24, 24]
    assert [o.token_ids for o in [first, *rest]] == expected


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_speculative_matches_hf(reference, family, backend):
    """n-gram drafts verified in one step give exactly the greedy tokens; some are accepted."""
    folder, _, _, hf = reference(family)
    base = random_prompts(4, 3, 6, 256, seed=11)
    prompts = [p * 5 for p in base]  # repetitive prompts: prompt lookup finds matches
    expected = hf_greedy(hf, prompts, 40)
    llm = LLM(
        str(folder),
        backend=backend,
        block_size=8,
        max_num_batched_tokens=32,
        max_model_len=128,
        num_speculative_tokens=3,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_draft_tokens_accepted for o in outs) > 0
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1
