"""Small random-weight Hugging Face models (Llama GQA, Qwen2, Qwen3, Mistral) for equality tests.

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
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
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
