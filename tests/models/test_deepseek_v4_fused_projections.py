"""Projections fused into one GEMM (`LinearGroup`, `fuse_projections`) against the members run
one by one: the group itself, whole models (fp32 and bf16), the HF loader and state dicts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    cast_model,
    init_random,
)
from kvplan.models.deepseek_v4.layers import LinearGroup, fuse_projections
from tests.models.dsv4_testlib import KINDS, hf_config, random_tokens, run_step, saved_pair


def _groups(model: nn.Module) -> list[LinearGroup]:
    return [m for m in model.modules() if isinstance(m, LinearGroup)]


def _unfuse(model: nn.Module) -> nn.Module:
    """Give every parameter its own storage: every group then runs its members one by one."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def _linears(seed: int, sizes=(3, 5, 1), dtype=torch.float32) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(8, n, bias=False).to(dtype) for n in sizes]


def test_group_is_one_gemm_with_view_outputs():
    members = _linears(0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    want = [F.linear(x, m.weight) for m in members]
    group = LinearGroup(*members)
    assert not group.is_fused()
    group.fuse()
    assert group.is_fused()
    fused = group._weight
    group.fuse()  # idempotent
    assert group._weight is fused
    for m in members:
        assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    got = group(x)
    base = got[0].untyped_storage().data_ptr()
    for g, w in zip(got, want, strict=True):
        assert g.untyped_storage().data_ptr() == base  # column views of one output
        assert g.stride() == (sum(group.sizes), 1)
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_group_in_place_writes_stay_fused_and_replaced_weights_fall_back():
    members = _linears(2)
    group = LinearGroup(*members)
    group.fuse()
    x = torch.randn(4, 8)
    with torch.no_grad():
        members[1].weight.copy_(torch.randn(5, 8))  # e.g. the loader, load_state_dict
    assert group.is_fused()
    torch.testing.assert_close(group(x)[1], F.linear(x, members[1].weight), atol=1e-6, rtol=0)
    members[2].weight.data = torch.randn(1, 8)  # a replaced weight: run unfused
    assert not group.is_fused()
    for g, m in zip(group(x), members, strict=True):
        torch.testing.assert_close(g, F.linear(x, m.weight), atol=0, rtol=0)
    assert group._weight is None
    group.fuse()
    assert group.is_fused()


def test_group_rejects_bad_members():
    with pytest.raises(TypeError, match=r"members\[1\]"):
        LinearGroup(nn.Linear(8, 2, bias=False), nn.Linear(8, 2, bias=True))
    with pytest.raises(ValueError, match="in_features"):
        LinearGroup(nn.Linear(8, 2, bias=False), nn.Linear(4, 2, bias=False))
    a, b = _linears(3, (2, 2))
    b.weight.data = b.weight.data.double()
    with pytest.raises(ValueError, match="member 1 weight is torch.float64"):
        LinearGroup(a, b).fuse()


def _model(seed: int) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_hf(hf_config(seed))
    return init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.1)


def _prefill_then_decode(model: DeepseekV4ForCausalLM, seed: int) -> list[torch.Tensor]:
    family = ReferenceHybridFamily(model.config.layer_specs())
    seqs = [random_tokens(seed + i, 19 + i) for i in range(3)]
    out, _ = run_step(model, family, [(i, s, 0, len(s) - 1) for i, s in enumerate(seqs)])
    last, _ = run_step(model, family, [(i, s, len(s) - 1, 1) for i, s in enumerate(seqs)])
    return out + last


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_fused_model_equals_unfused_fp32(seed):
    fused = _model(seed)
    groups = _groups(fused)
    assert groups and all(g.is_fused() for g in groups)
    assert {layer.self_attn.kind for layer in fused.layers} == set(KINDS)
    csa = [layer.self_attn for layer in fused.layers if layer.self_attn.indexer is not None]
    assert all(len(a.x_proj.sizes) == 7 for a in csa)  # q_a, kv, 2 + 2 compressor, weights
    assert all(len(a.q_res_proj.sizes) == 2 for a in csa)  # q_b and the indexer's q_b
    unfused = _unfuse(_model(seed))
    assert not any(g.is_fused() for g in _groups(unfused))
    for got, want in zip(_prefill_then_decode(fused, seed), _prefill_then_decode(unfused, seed)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_bf16_gate_is_the_model_dtype_gemm_widened_after():
    """The compressor's gate is the model-dtype GEMM output, widened to fp32 afterwards, both
    fused and unfused; the two models agree to bf16 rounding."""
    seed = 4
    models = [cast_model(_model(seed), torch.bfloat16) for _ in range(2)]
    _unfuse(models[1])
    assert all(g.is_fused() for g in _groups(models[0]))
    seen: list[list[torch.dtype]] = [[], []]
    for k, model in enumerate(models):
        for layer in model.layers:
            comp = layer.self_attn.compressor
            if comp is not None:
                comp.register_forward_pre_hook(
                    lambda mod, args, k=k: seen[k].append((args[0].dtype, args[1].dtype))
                )
    outs = [_prefill_then_decode(m, seed) for m in models]
    assert seen[0] and seen[0] == seen[1]
    assert set(seen[0]) == {(torch.bfloat16, torch.bfloat16)}
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


@torch.no_grad()
def test_loaded_folder_fills_fused_weights_and_state_dict_round_trips(tmp_path):
    hf, model = saved_pair(tmp_path, seed=5)
    assert all(g.is_fused() for g in _groups(model))
    hf_state = hf.state_dict()
    for i, layer in enumerate(model.layers):
        attn, prefix = layer.self_attn, f"model.layers.{i}.self_attn."
        want = [hf_state[prefix + "q_a_proj.weight"], hf_state[prefix + "kv_proj.weight"]]
        if attn.compressor is not None:
            want += [hf_state[prefix + f"compressor.{n}.weight"] for n in ("kv_proj", "gate_proj")]
        if attn.indexer is not None:
            ix = prefix + "compressor.indexer."
            want += [hf_state[ix + f"{n}.weight"] for n in ("kv_proj", "gate_proj")]
            want.append(hf_state[ix + "scorer.weights_proj.weight"])
        torch.testing.assert_close(attn.x_proj._weight, torch.cat(want), atol=0, rtol=0)
        want = [hf_state[prefix + "q_b_proj.weight"]]
        if attn.indexer is not None:
            want.append(hf_state[prefix + "compressor.indexer.q_b_proj.weight"])
        torch.testing.assert_close(attn.q_res_proj._weight, torch.cat(want), atol=0, rtol=0)
        sh = f"model.layers.{i}.mlp.shared_experts."
        torch.testing.assert_close(
            layer.mlp.shared.gate_up_proj._weight,
            torch.cat([hf_state[sh + "gate_proj.weight"], hf_state[sh + "up_proj.weight"]]),
            atol=0,
            rtol=0,
        )
    state = model.state_dict()
    assert not any("x_proj" in k or "gate_up_proj" in k for k in state)
    copy = DeepseekV4ForCausalLM(model.config)
    copy.load_state_dict(state)
    assert all(g.is_fused() for g in _groups(copy))
    ids = random_tokens(6, 15)
    family = ReferenceHybridFamily(model.config.layer_specs())
    (want,), _ = run_step(model, family, [(0, ids, 0, 15)])
    family = ReferenceHybridFamily(model.config.layer_specs())
    (got,), _ = run_step(copy, family, [(0, ids, 0, 15)])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@torch.no_grad()
def test_to_refuses_and_fuse_projections_is_idempotent():
    model = _model(7)
    before = [g._weight for g in _groups(model)]
    assert fuse_projections(model) is model
    assert all(g._weight is w for g, w in zip(_groups(model), before, strict=True))  # no copy
    model.to(torch.float64)
    for g in _groups(model):
        assert g.is_fused() and g._weight.dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_strided_views_through_cuda_kernels_equal_contiguous(dtype):
    """The Triton RMSNorm and SwiGLU read the group's column views (row stride = the fused
    width) as they read contiguous copies; the shared expert fused equals it unfused."""
    from kvplan.models.deepseek_v4.layers import rms_norm
    from kvplan.models.deepseek_v4.moe import SharedExpert

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 256, generator=gen, device="cuda").to(dtype)
    members = [nn.Linear(256, n, bias=False, device="cuda", dtype=dtype) for n in (96, 64, 40)]
    group = LinearGroup(*members)
    group.fuse()
    norm = 1 + 0.1 * torch.randn(96, generator=gen, device="cuda")
    q_a = group(x)[0]
    assert q_a.stride() == (200, 1)
    torch.testing.assert_close(
        rms_norm(q_a, norm, 1e-6), rms_norm(q_a.contiguous(), norm, 1e-6), atol=0, rtol=0
    )
    torch.manual_seed(1)
    shared = fuse_projections(SharedExpert(256, 128, limit=7.0).to("cuda", dtype))
    assert shared.gate_up_proj.is_fused()
    got = shared(x)  # [32, 256]
    _unfuse(shared)
    assert not shared.gate_up_proj.is_fused()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, shared(x), **tol)
