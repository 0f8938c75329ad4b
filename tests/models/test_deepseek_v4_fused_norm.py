"""The blocks' input RMSNorms inside the hyper-connection ops (`model.HC_FUSED_NORM`): the
model's logits against Hugging Face's full forward (the independent reference) and equal to
the separate-norm path, for prompts and decode rows; on CUDA (fp32 weights) within rounding
of the separate-norm path, eager and in a mixed batch."""

from __future__ import annotations

import pytest
import torch
from dsv4_testlib import hf_logits, random_tokens, run_step, saved_pair

from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import model as dsv4_model


def _logits(model, ids, prompt_len):
    family = ReferenceHybridFamily(model.config.layer_specs())
    (head,), _ = run_step(model, family, [(4, ids, 0, prompt_len)])
    pieces = [head]
    for q in range(prompt_len, len(ids)):
        (row,), _ = run_step(model, family, [(4, ids, q, 1)])
        pieces.append(row)
    return torch.cat(pieces)


@pytest.mark.parametrize("seed", [0, 2])
def test_fused_norm_matches_hf_and_the_separate_norms(seed, tmp_path, monkeypatch):
    hf, model = saved_pair(tmp_path, seed)
    ids = random_tokens(seed + 30, 29)
    separate = _logits(model, ids, 23)
    monkeypatch.setattr(dsv4_model, "HC_FUSED_NORM", True)
    fused = _logits(model, ids, 23)
    torch.testing.assert_close(fused, hf_logits(hf, ids), atol=1e-4, rtol=0)
    assert torch.equal(fused, separate)  # CPU: the same torch ops in the same order


@pytest.mark.gpu
def test_cuda_fused_norm_matches_the_separate_norms(tmp_path, monkeypatch):
    """CUDA: the norm in the epilogue kernel (decode rows, small prompts) and after the row
    tiles (a prompt of more than 256 rows) against the separate launches."""
    hf, model = saved_pair(tmp_path, 1)
    model = model.cuda()
    ids = random_tokens(41, 300, vocab=hf.config.vocab_size)
    for prompt_len in (12, 290):
        separate = _logits(model, ids[: prompt_len + 4], prompt_len)
        monkeypatch.setattr(dsv4_model, "HC_FUSED_NORM", True)
        fused = _logits(model, ids[: prompt_len + 4], prompt_len)
        monkeypatch.setattr(dsv4_model, "HC_FUSED_NORM", False)
        torch.testing.assert_close(fused, separate, atol=2e-4, rtol=1e-4)
