"""Small random-weight Hugging Face models (Llama GQA, Qwen2, Qwen3, Mistral, Gemma 3) for
equality tests.

``initializer_range`` is large (0.2) so that random logits are well separated and greedy
decoding is not decided by fp32 rounding noise.
"""

from __future__ import annotations

import torch

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    initializer_range=0.2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def make_hf_model(family: str, seed: int = 0):
    """(hf model in eval mode, fp32 CPU) of ``family``: llama, llama3, qwen2, qwen3, mistral."""
    import transformers as tf

    kw = dict(COMMON)
    if family == "llama":
        cfg = tf.LlamaConfig(**kw)
    elif family == "llama3":  # llama3 RoPE scaling + tied embeddings
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = tf.LlamaConfig(tie_word_embeddings=True, **kw)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**kw)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(head_dim=32, **kw)
    elif family == "mistral":
        cfg = tf.MistralConfig(sliding_window=12, **kw)
    elif family == "gemma3":
        return make_gemma3_model(seed)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.float().eval()


def make_gemma3_model(seed: int = 0, *, window: int = 12, layer_types: tuple[str, ...] = ()):
    """A random Gemma 3 text model: sliding layers of ``window`` then one full layer (default
    ``sliding, sliding, full``), head_dim 16 with ``query_pre_attn_scalar`` 24 (so the scale is
    not head_dim's), RoPE bases 1e4 local / 1e6 global, and random norm weights (the
    checkpoint's zero init would hide the ``1 + w`` scaling). The embedding is drawn small
    (std 0.02): with the tied head and the ``sqrt(hidden)`` scale a large one makes every
    continuation repeat its last token."""
    import transformers as tf

    types = list(layer_types or ("sliding_attention", "sliding_attention", "full_attention"))
    kw = dict(COMMON, num_hidden_layers=len(types), num_key_value_heads=1)
    cfg = tf.Gemma3TextConfig(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=window,
        layer_types=types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **kw,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
    return model.float().eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts in one left-padded ``generate`` call, ignoring EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None  # run all max_new_tokens, like ignore_eos=True
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        gen_cfg.eos_token_id = saved
    assert out.shape[1] == width + max_new_tokens, "HF generate stopped early"
    return out[:, width:].tolist()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]
