"""Model config parsing, RoPE frequencies and weight loading against Hugging Face."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvplan.models.config import ModelConfig, RopeConfig, named_config
from kvplan.models.rope import RotaryTable, inv_frequencies
from kvplan.models.weights import init_random_weights, load_weights

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip


def test_config_families():
    llama = ModelConfig.from_hf(tf.LlamaConfig(**SMALL))
    assert (llama.head_dim, llama.qkv_bias, llama.qk_norm, llama.layer_windows) == (
        16, False, False, None)  # fmt: skip
    qwen2 = ModelConfig.from_hf(tf.Qwen2Config(**SMALL))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.layer_windows is None
    qwen3 = ModelConfig.from_hf(tf.Qwen3Config(head_dim=32, **SMALL))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    mistral = ModelConfig.from_hf(tf.MistralConfig(sliding_window=8, **SMALL))
    assert mistral.layer_windows == (8, 8, 8, 8)
    mixed = ModelConfig.from_hf(
        tf.Qwen2Config(
            sliding_window=8,
            use_sliding_window=True,
            max_window_layers=2,
            layer_types=[
                "full_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            **SMALL,
        )  # fmt: skip
    )
    assert mixed.layer_windows == (None, None, 8, 8)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=12, intermediate_size=8, num_layers=1,
                    num_heads=3, num_kv_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="layer_windows"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                    num_heads=2, num_kv_heads=2, layer_windows=(4,))  # fmt: skip
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rope_type="yarn")
    with pytest.raises(ValueError, match="unknown model config"):
        named_config("nope")
    assert named_config("llama-1b").num_params == pytest.approx(1.236e9, rel=0.01)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_inv_frequencies_match_hf(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = tf.LlamaConfig(rope_parameters=params, max_position_embeddings=131072, **SMALL)
    ours = inv_frequencies(ModelConfig.from_hf(hf_cfg).rope, 16)
    if params["rope_type"] == "default":
        theirs = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    assert torch.equal(ours, theirs)


def test_rotary_table_matches_hf_rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = tf.LlamaConfig(**SMALL)
    table = RotaryTable(RopeConfig(), 16, 64, dtype=torch.float32)
    pos = torch.tensor([0, 5, 63, 17])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 4, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q2, k2 = table.apply(q, k, pos)
    assert torch.equal(q2, q_hf[0].transpose(0, 1)) and torch.equal(k2, k_hf[0].transpose(0, 1))


def _build(cfg):
    from kvplan.backends import get_backend
    from kvplan.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(cfg, get_backend("vanilla"), max_positions=64)


def test_load_weights_fuses_and_checks():
    hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)).eval()
    cfg = ModelConfig.from_hf(hf.config)
    model = _build(cfg)
    state = hf.state_dict()
    load_weights(model, state.items())
    attn = model.layers[1].self_attn
    q, kv = 64, 32
    assert torch.equal(
        attn.qkv_proj.weight[q : q + kv], state["model.layers.1.self_attn.k_proj.weight"]
    )
    assert torch.equal(attn.qkv_proj.bias[q + kv :], state["model.layers.1.self_attn.v_proj.bias"])
    assert torch.equal(
        model.layers[2].mlp.gate_up_proj.weight[96:], state["model.layers.2.mlp.up_proj.weight"]
    )
    with pytest.raises(ValueError, match="unexpected weight name"):
        load_weights(model, [("model.mystery.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, [("model.norm.weight", torch.zeros(3))])
    missing = {k: v for k, v in state.items() if "down_proj" not in k}
    with pytest.raises(ValueError, match="down_proj"):
        load_weights(_build(cfg), missing.items())


def test_random_init_is_seeded_and_tied_head_is_the_embedding():
    cfg = named_config("tiny-llama", tie_word_embeddings=True)
    a, b = _build(cfg), _build(cfg)
    init_random_weights(a, seed=3)
    init_random_weights(b, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a.lm_head is None and a.lm_head_weight is a.embed_tokens.weight
    assert torch.equal(a.norm.weight, torch.ones(64))
