"""The models' use of `kvplan.ops.l2_prefetch` (``KVPLAN_L2_PREFETCH``): which weights each
layer asks into L2, and that the logits do not change."""

import torch
from fused_testlib import DenseCausal

from kvplan.models.config import named_config
from kvplan.models.llama import LlamaForCausalLM
from kvplan.ops import l2_prefetch as lp


def test_llama_forward_hands_each_layer_its_weights(monkeypatch):
    """The model's plumbing (fused path, interpreter on the CPU): layer i issues its o
    projection and layer i+1's qkv before its attention and joins before the o projection;
    the logits are those of the model without the setting, bit for bit."""
    cfg = named_config("tiny-llama", num_layers=3)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg, DenseCausal, max_positions=16, fused_kernels=True)
    monkeypatch.setenv(lp.L2_PREFETCH_ENV, "o,qkv")
    pre = LlamaForCausalLM(cfg, DenseCausal, max_positions=16, fused_kernels=True)
    pre.load_state_dict(plain.state_dict())
    assert pre.l2_prefetch_parts == {"o", "qkv"}
    events = []
    monkeypatch.setattr(pre._l2, "issue", lambda ts: events.append(("issue", ts)))
    monkeypatch.setattr(pre._l2, "join", lambda: events.append(("join",)))
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(6)
    assert torch.equal(pre(ids, pos, None), plain(ids, pos, None))
    layers = pre.layers
    n = len(layers)
    want = []
    for i in range(n):
        ts = (layers[i].self_attn.o_proj.weight,)
        if i + 1 < n:
            ts += (layers[i + 1].self_attn.qkv_proj.weight,)
        want += [("issue", ts), ("join",)]
    assert len(events) == len(want)
    for got, exp in zip(events, want):
        assert got[0] == exp[0]
        if got[0] == "issue":
            assert len(got[1]) == len(exp[1]) and all(a is b for a, b in zip(got[1], exp[1]))
    events.clear()
    pre.fused_kernels = False  # the torch path (and steps over PREFETCH_MAX_ROWS) issue none
    pre(ids, pos, None)
    assert events == []


def test_deepseek_v4_attention_asks_for_its_output_projections(monkeypatch, tmp_path):
    """With ``o`` each DeepSeek-V4 attention layer issues its ``o_a`` / ``o_b`` weights before
    ``ctx.attend`` and joins after it; the logits equal the model's without the setting."""
    from dsv4_testlib import random_tokens, run_step, saved_pair

    from kvplan.backends.hybrid.reference import ReferenceHybridFamily
    from kvplan.models.deepseek_v4 import load_deepseek_v4

    _, plain = saved_pair(tmp_path, 1)
    monkeypatch.setenv(lp.L2_PREFETCH_ENV, "o")
    pre = load_deepseek_v4(tmp_path / "dsv4_1", torch.float32, "cpu")
    events = []
    for layer in pre.layers:
        attn = layer.self_attn
        assert attn.l2_prefetch is not None
        monkeypatch.setattr(attn.l2_prefetch, "issue", lambda ts: events.append(ts))
        monkeypatch.setattr(attn.l2_prefetch, "join", lambda: events.append("join"))
    ids = random_tokens(5, 9)
    family = ReferenceHybridFamily(plain.config.layer_specs())
    (want,), _ = run_step(plain, family, [(1, ids, 0, len(ids))])
    family = ReferenceHybridFamily(pre.config.layer_specs())
    (got,), _ = run_step(pre, family, [(1, ids, 0, len(ids))])
    assert torch.equal(got, want)
    assert len(events) == 2 * len(pre.layers)
    for layer, ts, join in zip(pre.layers, events[::2], events[1::2]):
        attn = layer.self_attn
        assert join == "join" and ts[0] is attn.o_a_proj.weight and ts[1] is attn.o_b_proj.weight
    assert all(layer.self_attn.l2_prefetch is None for layer in plain.layers)
