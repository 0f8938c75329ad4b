"""DeepSeek-V4 config parsing, RoPE tables, weight loading and the reference family's checks."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from dsv4_testlib import hf_config, hf_logits, hf_model, random_tokens, run_step
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    cast_model,
    init_random,
    load_deepseek_v4,
)
from kvplan.models.deepseek_v4.layers import Rope


def test_defaults_follow_hf():
    hf = tf.DeepseekV4Config()
    cfg = DeepseekV4Config.from_hf(hf.to_dict())
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert (cfg.csa_ratio, cfg.hca_ratio, cfg.rope_head_dim) == (4, 128, 64)
    bare = DeepseekV4Config.from_hf({"model_type": "deepseek_v4", "num_hidden_layers": 5})
    assert bare.layer_types == tuple(tf.DeepseekV4Config(num_hidden_layers=5).layer_types)
    legacy = DeepseekV4Config.from_hf({"num_hidden_layers": 3, "compress_ratios": [0, 4, 128]})
    assert legacy.layer_types == (
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")  # fmt: skip
    specs = DeepseekV4Config.from_hf(hf_config(0)).layer_specs()
    csa = [s for s in specs if s.kind == "compressed_sparse_attention"][0]
    assert (csa.ratio, csa.num_index_heads, csa.index_head_dim, csa.top_k > 0) == (4, 8, 8, True)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"o_groups": 3}, "o_groups"),
        ({"model_type": "llama"}, "model_type"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"partial_rotary_factor": 0.1, "rope_parameters": None}, "rope_head_dim"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_layer_types": ["moe"]}, "mlp_layer_types"),
    ],
)
def test_bad_config_names_the_field(override, field):
    d = hf_config(0).to_dict()
    d.update(num_hidden_layers=3, layer_types=d["layer_types"][:3], mlp_layer_types=["moe"] * 3)
    d.update(override)
    with pytest.raises(ValueError, match=field):
        DeepseekV4Config.from_hf(d)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        None,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {  # nested, no attention_factor: HF derives it from mscale / mscale_all_dim
            "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
            "compress": {"rope_type": "yarn", "rope_theta": 80000.0, "factor": 8.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 0.5, "beta_fast": 16, "partial_rotary_factor": 0.5},
        },
    ],
)  # fmt: skip
def test_rope_tables_match_hf(rope_parameters):
    hf = hf_config(1, rope_parameters=rope_parameters)
    cfg = DeepseekV4Config.from_hf(hf.to_dict())
    ref = DeepseekV4RotaryEmbedding(hf)
    for label, spec in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
        ours = Rope(spec, cfg.rope_head_dim)
        torch.testing.assert_close(ours.inv_freq, getattr(ref, f"{label}_inv_freq"))
        assert ours.scale == pytest.approx(getattr(ref, f"{label}_attention_scaling"))
    if rope_parameters and "main" in rope_parameters:
        assert cfg.compress_rope.attention_factor != 1.0


def _saved(tmp_path, seed=2):
    hf = hf_model(hf_config(seed), seed)
    hf.save_pretrained(tmp_path)
    return hf, next(tmp_path.glob("*.safetensors"))


def test_loader_accepts_transformers_module_names(tmp_path):
    hf, path = _saved(tmp_path)
    path.unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    model = load_deepseek_v4(tmp_path)
    ids = random_tokens(3, 21)
    (got,), _ = run_step(
        model, ReferenceHybridFamily(model.config.layer_specs()), [(0, ids, 0, 21)]
    )
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_loader_errors_name_file_and_tensor(tmp_path):
    _, path = _saved(tmp_path)
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("attn.wq_a.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"{path.name}.*{name}"):
        load_deepseek_v4(tmp_path)
    del tensors[name]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"no tensor for 'layers\.\d+\.self_attn\.q_a_proj"):
        load_deepseek_v4(tmp_path)
    tensors["model.layers.0.attn.mystery"] = torch.zeros(1)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="mystery"):
        load_deepseek_v4(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_deepseek_v4(tmp_path)


def test_random_init_and_bf16_cast_keep_fp32_parts():
    cfg = DeepseekV4Config.from_hf(hf_config(3))
    model = cast_model(init_random(DeepseekV4ForCausalLM(cfg), seed=1, std=0.1), torch.bfloat16)
    attn = next(layer.self_attn for layer in model.layers if layer.self_attn.indexer is not None)
    assert attn.sinks.dtype == torch.float32 and attn.sinks.abs().sum() > 0
    assert attn.compressor.position_bias.dtype == torch.float32
    assert attn.compressor.position_bias.abs().sum() > 0
    assert attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.layers[0].attn_hc.fn.dtype == torch.float32
    ids = random_tokens(5, 30)
    family = ReferenceHybridFamily(cfg.layer_specs())
    (one,), _ = run_step(model, family, [(0, ids, 0, 30)])
    (a,), _ = run_step(model, family, [(0, ids, 0, 13)])
    (b,), _ = run_step(model, family, [(0, ids, 13, 17)])
    assert one.dtype == torch.float32 and torch.isfinite(one).all()
    torch.testing.assert_close(torch.cat([a, b]), one, atol=0.1, rtol=0.05)


def test_reference_family_rejects_bad_steps():
    cfg = DeepseekV4Config.from_hf(hf_config(0))
    model = init_random(DeepseekV4ForCausalLM(cfg), seed=0)
    family = ReferenceHybridFamily(cfg.layer_specs())
    ids = random_tokens(0, 12)
    run_step(model, family, [(0, ids, 0, 8)])
    with pytest.raises(ValueError, match="q_start 5 but the family holds 8"):
        family.plan([HybridSeq(0, 5, 2, ids, (), 0)], torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="positions must be"):
        family.plan([HybridSeq(0, 8, 2, ids, (), 0)], torch.tensor([8, 10]))
    with pytest.raises(ValueError, match="twice"):
        seq = HybridSeq(0, 8, 1, ids, (), 0)
        family.plan([seq, seq], torch.tensor([8, 8]))
    ctx = family.plan([HybridSeq(0, 8, 1, ids, (), 0)], torch.tensor([8]))
    csa = next(
        i for i, s in enumerate(cfg.layer_specs()) if s.kind == "compressed_sparse_attention"
    )
    q = torch.zeros(1, cfg.num_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="before store_entries"):
        ctx.compress_windows(csa, "compressor", torch.zeros(1, 32), torch.zeros(1, 32))
        ctx.attend(csa, q, torch.zeros(1, cfg.head_dim), torch.zeros(cfg.num_heads), 1.0,
                   index_q=torch.zeros(1, 8, 8), index_weights=torch.zeros(1, 8))  # fmt: skip
    family.free(0)
    assert family.num_tokens(0) == 0


@torch.no_grad()
def test_logits_indices_select_rows():
    cfg = DeepseekV4Config.from_hf(hf_config(1))
    model = init_random(DeepseekV4ForCausalLM(cfg), seed=2, std=0.1)
    ids = torch.tensor(random_tokens(6, 11))
    pos = torch.arange(11)
    seq = [HybridSeq(0, 0, 11, ids.tolist(), (), 0)]
    full = model(ids, pos, ReferenceHybridFamily(cfg.layer_specs()).plan(seq, pos))
    picked = model(
        ids, pos, ReferenceHybridFamily(cfg.layer_specs()).plan(seq, pos), torch.tensor([10, 3])
    )
    assert picked.shape == (2, cfg.vocab_size) and picked.dtype == torch.float32
    torch.testing.assert_close(picked, full[[10, 3]])
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.int(), pos, None)
