"""CUDA-graph decode steps: bucket choice (CPU) and graph vs eager token equality (GPU)."""

from __future__ import annotations

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.engine.cuda_graphs import bucket_for, decode_buckets
from kvplan.models.config import named_config


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    b = decode_buckets(40)
    assert [bucket_for(n, b) for n in (1, 3, 9, 33, 40, 41)] == [1, 4, 16, 40, 40, None]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_cpu_engine_has_no_graphs():
    llm = LLM(named_config("tiny-llama"), max_model_len=64)
    assert llm.engine.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["block_offsets"])
def test_graph_decode_matches_eager_on_gpu(backend):
    cfg = named_config("tiny-llama", head_dim_override=64, num_heads=4, num_kv_heads=2,
                       hidden_size=256)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (11,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(cfg, device="cuda", backend=backend, max_num_seqs=16, max_model_len=128,
                  use_cuda_graph=graphs, num_blocks=200)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert llm.engine.runner.graphs is not None
            assert llm.engine.runner.graphs.num_replays > 0
    assert outs[True] == outs[False]
