"""LLM API: prompts as text or ids, streaming, stop strings/ids, `kvplan generate`."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.models.config import named_config

# CPU fp32 semantics (token equality with HF fp32) even where CUDA is present
LLM = partial(_LLM, device="cpu")


@pytest.fixture(scope="module")
def tiny():
    return LLM(named_config("tiny-llama"), backend="ragged", block_size=4, max_model_len=96)


class CharTokenizer:
    """Token t <-> the letter chr(97 + t % 26); enough for stop-string logic."""

    eos_token_id = None
    chat_template = None

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def test_streaming_equals_batch(tiny):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = tiny.generate([[3, 4, 5]], params)[0]
    deltas = list(tiny.generate_stream([3, 4, 5], params))
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])


def test_single_prompt_and_errors(tiny):
    out = tiny.generate([1, 2, 3], SamplingParams(max_tokens=3))
    assert len(out) == 1 and len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny.generate("hello")
    with pytest.raises(ValueError, match="max_model_len"):
        tiny.generate([1] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="sampling params"):
        tiny.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a sequence "
                                        "of them, got dict"):  # fmt: skip
        tiny.generate([[1, 2]], {"max_tokens": 2})
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got int"):
        tiny.generate([[1], [2]], [SamplingParams(), 3])
    assert not tiny.engine.has_unfinished()  # nothing was added


def test_stop_token_ids_and_strings():
    llm = LLM(named_config("tiny-llama"), backend="vanilla", max_model_len=96)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    free = llm.generate([[9, 8, 7]], params)[0].token_ids
    stop_tok = free[5]
    first = free.index(stop_tok)
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=30, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"

    llm.tokenizer = CharTokenizer()
    llm.engine.decode_text = llm.tokenizer.decode
    text = llm.tokenizer.decode(free)
    stop = text[7:9]
    cut = text.find(stop)
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=30, stop=[stop]))[0]
    assert out.text == text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == free[: cut + 2]


def test_seeded_sampling_is_reproducible(tiny):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    a = tiny.generate([[1, 2], [5, 6, 7]], [p, p])
    b = tiny.generate([[5, 6, 7]], p)
    assert a[1].token_ids == b[0].token_ids


def test_generate_cli_prints_only_the_completion(tmp_path, capsys):
    """`kvplan generate` with a tiny random model that carries a real (SmolLM2) tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvplan.cli import main
    from kvplan.models.loader import default_gguf_path

    try:
        gguf = default_gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                      eos_token_id=tok.eos_token_id)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    capsys.readouterr()
    rc = main(["generate", "Hello there", "--model", str(tmp_path), "--max-tokens", "6",
               "--backend", "vanilla", "--device", "cpu"])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0
    llm = LLM(str(tmp_path), backend="vanilla", max_model_len=256)
    want = llm.generate("Hello there", SamplingParams(max_tokens=6))[0].text
    assert cap.out == want + "\n"
    assert "kvplan:" in cap.err


def test_engine_reads_logits_in_the_model_dtype():
    """The engine turns off the models' fp32 logits copy (``float_logits``): a bf16 engine
    gets bf16 logits, and its greedy tokens, seeded samples and logprobs are those of the
    same engine reading the fp32 copy (the same values widened)."""
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5]]
    greedy = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=4, logprobs=2)

    def run(float_logits: bool):
        llm = LLM(named_config("tiny-llama"), backend="vanilla", max_model_len=96,
                  dtype=torch.bfloat16)  # fmt: skip
        model = llm.engine.runner.model
        assert model.float_logits is False
        model.float_logits = float_logits
        outs = llm.generate(prompts, [greedy, sampled])
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs]

    assert run(False) == run(True)
