"""The engine on CUDA: backends agree, KV formats run, load with graphs equals one by one.

CPU counterparts: ``test_hf_equality.py`` (backends x HF), ``test_load.py`` (load, preemption).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.models.config import named_config

CFG = named_config("tiny-llama", hidden_size=256, num_heads=4, num_kv_heads=2,
                   head_dim_override=64)  # fmt: skip


def _prompts(n, seed, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, hi))] for _ in range(n)]


@pytest.mark.gpu
def test_backends_agree_on_gpu_fp32():
    prompts = _prompts(8, 0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outs = {}
    for backend in ("vanilla", "ragged", "block_offsets"):
        llm = LLM(CFG, device="cuda", dtype="float32", backend=backend, max_model_len=128,
                  max_num_batched_tokens=48, num_blocks=300)  # fmt: skip
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["ragged"] == outs["vanilla"]
    assert outs["block_offsets"] == outs["vanilla"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
@pytest.mark.parametrize("backend", ["vanilla", "ragged", "block_offsets"])
def test_bf16_model_runs_every_backend_and_format(backend, kv_format):
    llm = LLM(CFG, device="cuda", backend=backend, kv_format=kv_format, max_model_len=128,
              num_blocks=300)  # fmt: skip
    outs = llm.generate(_prompts(5, 1), SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20] * 5
    assert llm.parts.manager.num_free_blocks() == 299


@pytest.mark.gpu
def test_load_with_graphs_equals_one_by_one_on_gpu():
    prompts = _prompts(40, 2, hi=40)
    rng = random.Random(3)
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    # same block size as below: the Triton kernels compile once for both engines
    alone = LLM(CFG, device="cuda", dtype="float32", block_size=4, max_num_seqs=1,
                max_model_len=80, use_cuda_graph=False, enable_prefix_caching=False)  # fmt: skip
    want = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(CFG, device="cuda", dtype="float32", block_size=4, max_model_len=80,
              max_num_seqs=16, max_num_batched_tokens=48, num_blocks=45)  # fmt: skip
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want
    assert llm.parts.manager.num_free_blocks() == 44
    # the metadata's per-step copies went through the pinned ring (steps run ahead by at most
    # one, so its 4 buffers are never all in flight)
    ring = llm.engine.runner.metadata.arena.ring
    assert ring is not None and ring.sends > 0 and ring.busy == 0
    torch.cuda.synchronize()
