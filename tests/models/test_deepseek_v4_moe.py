"""DeepSeek-V4 MoE: the dense (sync-free, CUDA-graph capturable) expert path equals the sparse
one on random inputs (fp32, up to GEMM blocking: the batches differ), for top-k and hash
routers, incl. a hash row naming an expert twice."""

from __future__ import annotations

import pytest
import torch

from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from kvplan.models.deepseek_v4.moe import DeepseekV4MoE, graph_safe_routing
from tests.models.dsv4_testlib import hf_config


def _moes(seed: int, **overrides) -> list[DeepseekV4MoE]:
    cfg = DeepseekV4Config.from_hf(hf_config(seed, **overrides))
    with torch.device("cpu"):
        model = init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.3)
    return [layer.mlp for layer in model.layers]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 40])
def test_dense_experts_equal_sparse(seed, num_rows):
    moes = _moes(seed, n_routed_experts=6, num_experts_per_tok=2)
    assert {m.hash_routed for m in moes} == {True, False}  # both routers are covered
    gen = torch.Generator().manual_seed(seed * 100 + num_rows)
    for moe in moes:
        x = torch.randn(num_rows, moe.gate_weight.shape[1], generator=gen)
        ids = torch.randint(0, moe.tid2eid.shape[0] if moe.hash_routed else 96, (num_rows,),
                            generator=gen)  # fmt: skip
        with torch.no_grad():
            want = moe(x, ids)
            assert not moe.dense_routing
            r_ids, r_w = moe.route(x, ids)
            dense = moe.experts_dense(x, r_ids, r_w)
            sparse = moe.experts_sparse(x, r_ids, r_w)
            with graph_safe_routing(moe):
                got = moe(x, ids)
        assert not moe.dense_routing  # restored
        assert want.abs().max() > 0.1  # the experts do contribute
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(dense, sparse, atol=1e-6, rtol=1e-5)


def test_dense_experts_count_a_repeated_hash_expert_twice():
    moe = next(m for m in _moes(0) if m.hash_routed)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, moe.gate_weight.shape[1], generator=gen)
    ids = torch.tensor([[1, 1], [0, 3], [2, 2], [3, 0]])
    w = torch.rand(4, 2, generator=gen)
    with torch.no_grad():
        dense = moe.experts_dense(x, ids, w)
        sparse = moe.experts_sparse(x, ids, w)
        single = moe.experts_sparse(x, ids[:, :1], w.sum(dim=1, keepdim=True))
    torch.testing.assert_close(dense, sparse, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dense[[0, 2]], single[[0, 2]], atol=1e-6, rtol=1e-5)
