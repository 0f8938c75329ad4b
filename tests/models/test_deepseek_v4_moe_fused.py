"""DeepSeek-V4 MoE with fused weights (`DeepseekV4MoE.fuse_weights`): the router, every
routed expert's gate/up and the shared expert's gate/up as one GEMM's weight, the down
projections as one batched weight, the shared expert run as expert ``E``. Checked against
the unfused dense path (router GEMM, routed experts, shared expert apart) and the per-expert
sparse loop, on random inputs and both router kinds; and the views' life cycle (writes reach
the fused tensors, a replaced weight falls back to the unfused path, a cast fuses again,
weights of mixed dtypes stay apart)."""

from __future__ import annotations

import pytest
import torch

from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from kvplan.models.deepseek_v4.layers import fuse_projections
from kvplan.models.deepseek_v4.moe import DeepseekV4MoE, graph_safe_routing
from kvplan.models.deepseek_v4.weights import cast_model
from tests.models.dsv4_testlib import hf_config


def _model(seed: int, **overrides) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_hf(hf_config(seed, **overrides))
    with torch.device("cpu"):
        return init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.3)


def _inputs(moe: DeepseekV4MoE, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, moe.gate_weight.shape[1], generator=gen)
    vocab = moe.tid2eid.shape[0] if moe.hash_routed else 96
    return x, torch.randint(0, vocab, (rows,), generator=gen)


def _unfused_dense(moe: DeepseekV4MoE, x, ids) -> torch.Tensor:
    """The dense path the fusion replaces: router GEMM + routing, routed experts batched,
    the shared expert on its own weights, added after the routed sum is rounded."""
    _, _, dense = moe.route_dense(x, ids)
    return moe.experts_batched(x, dense, add=moe.shared(x))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fused_dense_equals_unfused_and_sparse(seed, rows):
    model = _model(seed, n_routed_experts=6, num_experts_per_tok=2)
    moes = [layer.mlp for layer in model.layers]
    assert {m.hash_routed for m in moes} == {True, False}
    for i, moe in enumerate(moes):
        assert moe.is_fused()
        x, ids = _inputs(moe, rows, seed * 10 + i)
        with torch.no_grad():
            fused = moe.experts_fused(x, ids)
            unfused = _unfused_dense(moe, x, ids)
            r_ids, r_w = moe.route(x, ids)
            sparse = moe.experts_sparse(x, r_ids, r_w) + moe.shared(x)
            with graph_safe_routing(moe):
                through_forward = moe(x, ids)
        assert sparse.abs().max() > 0.1
        torch.testing.assert_close(fused, unfused, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(fused, sparse, atol=1e-5, rtol=1e-5)  # other sum order
        assert torch.equal(through_forward, fused)  # dense routing takes the fused path


def test_fused_weights_are_views_and_writes_reach_them():
    model = _model(2)
    moe = model.layers[0].mlp
    x_weight, down_weight, _ = moe._fused
    e, two_i, hidden = moe.gate_up.shape
    inter = two_i // 2
    assert tuple(x_weight.shape) == ((e + 1) * two_i + e, hidden)
    assert tuple(down_weight.shape) == (e + 1, hidden, inter)
    sh = moe.shared
    assert torch.equal(x_weight[: e * two_i].view(e, two_i, hidden), moe.gate_up)
    assert torch.equal(x_weight[e * two_i : e * two_i + inter], sh.gate_proj.weight)
    assert torch.equal(x_weight[e * two_i + inter : (e + 1) * two_i], sh.up_proj.weight)
    assert torch.equal(x_weight[(e + 1) * two_i :], moe.gate_weight)
    assert torch.equal(down_weight[e], sh.down_proj.weight)
    assert sh.gate_up_proj.is_fused()  # the shared group runs on the same rows
    with torch.no_grad():  # an in-place write (as the checkpoint loader does) reaches them
        sh.up_proj.weight.copy_(torch.full_like(sh.up_proj.weight, 0.5))
        moe.gate_weight.mul_(2)
    assert moe.is_fused()
    assert (x_weight[e * two_i + inter : (e + 1) * two_i] == 0.5).all()
    assert torch.equal(x_weight[(e + 1) * two_i :], moe.gate_weight)
    x, ids = _inputs(moe, 4, 3)
    with torch.no_grad():
        torch.testing.assert_close(moe.experts_fused(x, ids), _unfused_dense(moe, x, ids),
                                   atol=1e-6, rtol=1e-5)  # fmt: skip


def test_replaced_weight_falls_back_then_fuses_again():
    model = _model(3)
    moe = next(layer.mlp for layer in model.layers if not layer.mlp.hash_routed)
    x, ids = _inputs(moe, 6, 4)
    with torch.no_grad():
        moe.shared.down_proj.weight.data = moe.shared.down_proj.weight.data * 1.5  # a copy
        assert not moe.is_fused()
        with pytest.raises(RuntimeError, match="fuse_weights"):
            moe.experts_fused(x, ids)
        with graph_safe_routing(moe):
            fallback = moe(x, ids)  # the unfused dense path, with the new weight
        want = _unfused_dense(moe, x, ids)
        torch.testing.assert_close(fallback, want, atol=1e-6, rtol=1e-5)
        fuse_projections(model)
        assert moe.is_fused()
        torch.testing.assert_close(moe.experts_fused(x, ids), want, atol=1e-6, rtol=1e-5)


def test_cast_fuses_again_and_mixed_dtypes_stay_apart():
    model = cast_model(_model(4), torch.bfloat16)  # as the engine loads a bf16 model
    for layer in model.layers:
        assert layer.mlp.is_fused()
        assert layer.mlp._fused[0].dtype == torch.bfloat16
    moe = model.layers[-1].mlp
    x, ids = _inputs(moe, 3, 5)
    with torch.no_grad():
        want = moe.experts_fused(x.bfloat16(), ids)
        moe.gate_weight.data = moe.gate_weight.data.float()  # a weight of another dtype
        moe.fuse_weights()
    assert not moe.is_fused() and moe._fused is None  # left apart: the unfused paths run
    assert moe.shared.gate_up_proj.is_fused()  # the shared group still runs as one GEMM
    assert want.dtype == torch.bfloat16 and want.abs().max() > 0.1


@pytest.mark.gpu
def test_fused_dense_on_cuda_matches_unfused_and_replays_in_a_graph():
    """bf16 on the GPU (Triton routing, SwiGLU and sum kernels; the router logits read as a
    strided column slice): the fused path against the unfused one within bf16 rounding, and
    a captured CUDA graph of the block replaying the same bits."""
    model = cast_model(_model(5, n_routed_experts=8, num_experts_per_tok=2).cuda(), torch.bfloat16)
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        assert moe.is_fused()
        x, ids = _inputs(moe, 12, 50 + i)
        x, ids = x.cuda().bfloat16(), ids.cuda()
        with torch.no_grad():
            fused = moe.experts_fused(x, ids)
            unfused = _unfused_dense(moe, x, ids)
            torch.testing.assert_close(fused, unfused, atol=2e-2, rtol=1.6e-2)
            assert fused.abs().max() > 0.1
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe(x, ids)  # warm-up off the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe(x, ids)
            graph.replay()
            torch.cuda.synchronize()
        assert torch.equal(out, fused)
