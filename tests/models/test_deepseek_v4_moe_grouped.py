"""DeepSeek-V4 MoE, grouped expert path: equal to the sparse path block by block, and the tiny
random model with the grouped path forced (its Triton kernels, the interpreter on CPU) still
matches Hugging Face's logits within the model test's tolerance."""

from __future__ import annotations

import pytest
import torch

import kvplan.models.deepseek_v4.moe as moe_module
from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from kvplan.ops.moe_grouped import moe_grouped_triton
from tests.models.dsv4_testlib import hf_config, hf_logits, random_tokens, run_step, saved_pair

ATOL = 1e-4  # as tests/models/test_deepseek_v4_model.py


@pytest.fixture
def triton_grouped(monkeypatch):
    """Every MoE block takes the grouped path, through the Triton kernels."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return moe_grouped_triton(*args)

    monkeypatch.setenv("KVPLAN_MOE_GROUPED", "1")
    monkeypatch.setattr(moe_module, "moe_grouped", counted)
    return calls


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_rows", [1, 7, 40])
def test_grouped_experts_equal_sparse(seed, num_rows, monkeypatch):
    cfg = DeepseekV4Config.from_hf(hf_config(seed, n_routed_experts=6, num_experts_per_tok=3))
    with torch.device("cpu"):
        model = init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.3)
    gen = torch.Generator().manual_seed(seed * 100 + num_rows)
    for moe in (layer.mlp for layer in model.layers):
        x = torch.randn(num_rows, moe.gate_weight.shape[1], generator=gen)
        ids = torch.randint(0, 96, (num_rows,), generator=gen)
        with torch.no_grad():
            assert not moe.use_grouped(x) and not moe.use_dense(x)
            want = moe(x, ids)  # sparse
            moe.grouped_routing = True
            got = moe(x, ids)  # grouped, torch path
            monkeypatch.setattr(moe_module, "moe_grouped", moe_grouped_triton)
            got_triton = moe(x, ids)
            monkeypatch.undo()
            moe.grouped_routing = False
        scale = want.abs().max().item()
        assert scale > 0.1
        # fp32 sums of the same products in another order (the interpreter's K tiles vs the
        # host BLAS, whose order depends on the CPU): a few ulp of the output's scale
        atol = 4 * torch.finfo(torch.float32).eps * scale
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
        torch.testing.assert_close(got_triton, want, atol=atol, rtol=1e-5)


def test_grouped_auto_rule(monkeypatch):
    moe = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config(0))).layers[0].mlp
    x = torch.zeros(3, moe.gate_weight.shape[1])
    assert not moe.use_grouped(x)  # CPU, few experts: the existing rule
    monkeypatch.setenv("KVPLAN_MOE_GROUPED", "1")
    assert moe.use_grouped(x)


@pytest.mark.gpu
def test_grouped_auto_rule_on_cuda(monkeypatch):
    """CUDA: prefill-sized batches (not bound for the dense path) take the grouped path (no
    host sync per expert); decode-sized ones with few experts stay dense; ``=0`` opts out."""
    moe = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config(0))).layers[-1].mlp.cuda()
    e = moe.gate_up.shape[0]
    small = torch.zeros(e, moe.gate_weight.shape[1], device="cuda")
    large = torch.zeros(4096 // e + 1, moe.gate_weight.shape[1], device="cuda")
    assert moe.use_dense(small) and not moe.use_grouped(small)
    assert not moe.use_dense(large) and moe.use_grouped(large)
    monkeypatch.setenv("KVPLAN_MOE_GROUPED", "0")
    assert not moe.use_grouped(large)


@pytest.mark.parametrize("seed", [0, 3])
def test_model_with_grouped_experts_matches_hf(seed, tmp_path, triton_grouped):
    hf, model = saved_pair(tmp_path, seed)
    family = ReferenceHybridFamily(model.config.layer_specs())
    ids = random_tokens(seed + 20, 23)
    prompt = 19
    (head,), _ = run_step(model, family, [(5, ids, 0, prompt)])
    pieces = [head]
    for q_start in range(prompt, len(ids)):  # decode rows
        (logits,), _ = run_step(model, family, [(5, ids, q_start, 1)])
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces), hf_logits(hf, ids), atol=ATOL, rtol=0)
    num_layers = len(model.layers)
    assert triton_grouped.count(prompt) == num_layers  # every block ran the grouped kernels
    assert len(triton_grouped) == num_layers * (1 + len(ids) - prompt)
