"""Server test helpers: the API key and a tiny random Llama folder with a small word-level tokenizer and a chat template, built
offline (Hugging Face ``save_pretrained`` + a ``tokenizers`` WordLevel model)."""

from __future__ import annotations

from pathlib import Path

import torch

API_KEY = "test-key"
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(200)]
VOCAB_SIZE = 256  # >= len(SPECIALS) + len(WORDS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
        chat_template=CHAT_TEMPLATE,
    )


def make_model_folder(folder: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``folder``."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        initializer_range=0.2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder
