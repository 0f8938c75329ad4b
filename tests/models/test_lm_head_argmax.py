"""The models' ``argmax_out``: Llama, Gemma 3 and DeepSeek-V4 fill it with ``argmax(-1)`` of the
logits they return (CPU: the LM head's torch path, then `argmax_rows`), for all rows and for
``logits_indices``, in fp32 and with model-dtype logits; under tensor parallelism it is taken
of the gathered vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dsv4_testlib import random_tokens, saved_pair
from fused_testlib import DenseCausal, gen, model_with_random_weights

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.config import ModelConfig, named_config
from kvplan.models.llama import lm_head_logits


def _tokens(n: int) -> torch.Tensor:
    return torch.full((n,), -1, dtype=torch.int64)


@pytest.mark.parametrize("float_logits", [True, False])
def test_llama_fills_argmax_out(float_logits) -> None:
    cfg = named_config("tiny-llama", num_layers=2)
    model = model_with_random_weights(cfg, seed=3, dtype=torch.bfloat16)
    model.float_logits = float_logits
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=gen(4))
    pos = torch.arange(7)
    plain = model(ids, pos, None)
    tokens = _tokens(7)
    logits = model(ids, pos, None, argmax_out=tokens)
    assert torch.equal(logits, plain)
    assert logits.dtype == (torch.float32 if float_logits else torch.bfloat16)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    rows = torch.tensor([6, 2])
    some = _tokens(2)
    assert torch.equal(model(ids, pos, None, rows, argmax_out=some), plain[rows])
    assert some.tolist() == tokens[rows].tolist()
    with pytest.raises(ValueError, match="argmax_out must have shape \\(2,\\)"):
        model(ids, pos, None, rows, argmax_out=_tokens(7))


def test_gemma3_fills_argmax_out() -> None:
    from kvplan.models.gemma3 import Gemma3ForCausalLM
    from tests.engine.hf_models import make_gemma3_model

    cfg = ModelConfig.from_hf(make_gemma3_model(1).config)
    model = Gemma3ForCausalLM(cfg, DenseCausal, max_positions=64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen(5)) * 0.5)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=gen(6))
    tokens = _tokens(6)
    logits = model(ids, torch.arange(6), None, argmax_out=tokens)
    assert torch.equal(logits, model(ids, torch.arange(6), None))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert len(set(tokens.tolist())) > 1


def test_tensor_parallel_argmax_of_the_gathered_vocabulary() -> None:
    """`lm_head_logits` with a vocabulary split over two ranks (a stand-in ``tp`` whose
    ``gather_vocab`` returns the other rank's share too): the argmax is the gathered logits',
    not this rank's share's."""
    vocab, hidden = 40, 8
    w = torch.randn(vocab, hidden, generator=gen(7))
    h = torch.randn(3, hidden, generator=gen(8))
    full = h @ w.T
    full[:, 30] = full.max() + 1  # the best column lies in rank 1's share
    other = full[:, vocab // 2 :]

    class _TP:
        def gather_vocab(self, logits, size):
            assert size == vocab and logits.shape == (3, vocab // 2)
            return torch.cat([logits, other], dim=1)

    model = SimpleNamespace(tp=_TP(), lm_head_weight=w[: vocab // 2], float_logits=False,
                            config=SimpleNamespace(vocab_size=vocab))  # fmt: skip
    tokens = _tokens(3)
    logits = lm_head_logits(model, h, tokens)
    assert logits.shape == (3, vocab) and tokens.tolist() == [30, 30, 30]


def test_deepseek_v4_fills_argmax_out(tmp_path) -> None:
    _, model = saved_pair(tmp_path, 1)
    family = ReferenceHybridFamily(model.config.layer_specs())
    ids = random_tokens(1, 9)
    positions = torch.arange(9)
    ctx = family.plan([HybridSeq(0, 0, 9, ids, (), 0)], positions)
    rows = torch.tensor([8, 3, 5])
    tokens = _tokens(3)
    logits = model(torch.tensor(ids), positions, ctx, rows, argmax_out=tokens)
    assert logits.shape[0] == 3
    assert tokens.tolist() == logits.argmax(-1).tolist()
