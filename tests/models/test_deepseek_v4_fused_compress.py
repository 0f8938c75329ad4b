"""DeepSeek-V4 with the fused compressor step (``kvplan.ops.compress_store``, forced on the CPU
through ``KVPLAN_FUSED_COMPRESS=1``: the Triton interpreter) against the unfused path
(``compress_windows`` + ``pool`` + ``store_entries``): a chunked, mixed prefill and greedy
decode steps on the planned family (exact and FP8 rows), and static decode steps (the
CUDA-graph step run eagerly) against eager unfused steps. Greedy tokens are identical, logits
and caches equal within fp32 noise (the kernel sums the windows in another order).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvplan.backends.hybrid import planned_step
from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from tests.models.dsv4_testlib import hf_config, random_tokens

MAX_LEN = 64
BLOCK = 16


def _setup(seed: int, kv_format: str, num_seqs: int):
    # widths 32: whole scale groups in every quantized layout (the fused kernel's condition)
    cfg = DeepseekV4Config.from_hf(hf_config(seed, head_dim=32, index_head_dim=32))
    model = init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.1)
    per_seq = MAX_LEN // BLOCK

    def family() -> PlannedHybridFamily:
        return PlannedHybridFamily(cfg.layer_specs(), block_size=BLOCK,
                                   num_blocks=1 + num_seqs * per_seq, num_state_slots=num_seqs,
                                   max_model_len=MAX_LEN, kv_format=kv_format, check=True)  # fmt: skip

    def seq(i: int, tokens: list[int], q_start: int, n: int) -> HybridSeq:
        table = range(1 + i * per_seq, 1 + (i + 1) * per_seq)
        return HybridSeq(i, q_start, n, tokens, table, i)

    return model, family, seq


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """Names of the series the fused kernel served (through ``PlannedStep``)."""
    calls: list[str] = []
    real = planned_step.compress_store_triton

    def counted(*args, **kw):
        calls.append(args[10].note)
        return real(*args, **kw)

    monkeypatch.setattr(planned_step, "compress_store_triton", counted)
    return calls


def _step(model, fam, seqs) -> torch.Tensor:
    ids = torch.tensor([t for s in seqs for t in s.token_ids[s.q_start : s.q_start + s.seqlen_q]])
    pos = torch.cat([torch.arange(s.q_start, s.q_start + s.seqlen_q) for s in seqs])
    return model(ids, pos, fam.plan(seqs, pos))


@torch.no_grad()
def _generate(seed: int, kv_format: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Two prompts (one in two chunks, the second chunk sharing a step with the other
    prompt), then greedy decode steps of both rows."""
    model, family, seq = _setup(seed, kv_format, 2)
    fam = family()
    tokens = [random_tokens(seed, 19), random_tokens(seed + 1, 13)]
    logits = [_step(model, fam, [seq(0, tokens[0], 0, 7)])]
    out = _step(model, fam, [seq(0, tokens[0], 7, 12), seq(1, tokens[1], 0, 13)])
    logits.append(out)
    last = [out[11], out[-1]]
    for _ in range(9):
        for i in range(2):
            tokens[i].append(int(last[i].argmax()))
        out = _step(model, fam, [seq(i, tokens[i], len(tokens[i]) - 1, 1) for i in range(2)])
        logits.append(out)
        last = [out[0], out[1]]
    return tokens, logits


@pytest.mark.parametrize(("seed", "kv_format"), [(0, "exact"), (1, "fp8")])
def test_fused_compressor_equals_unfused(monkeypatch, fused_calls, seed, kv_format):
    monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "0")
    want_tokens, want = _generate(seed, kv_format)
    assert not fused_calls
    monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "1")
    got_tokens, got = _generate(seed, kv_format)
    assert len(fused_calls) >= 11  # every step's compressed series
    assert got_tokens == want_tokens
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@torch.no_grad()
def test_static_fused_step_equals_eager_unfused_step(monkeypatch, fused_calls):
    """Static decode steps (padding rows, stand-in windows stored at slot -1, the ring
    written in the kernel's launch) with the fused path against eager unfused steps."""
    seed, num_seqs = 2, 3
    model, family, seq = _setup(seed, "exact", num_seqs)
    eager, static = family(), family()
    buffers = StaticDecodeBuffers(static, 4)
    step = StaticDecodeStep(static, 4, buffers)
    rng = random.Random(seed)
    tokens = {i: random_tokens(seed * 10 + i, rng.randint(4, 12)) for i in range(num_seqs)}
    monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "0")
    prompt = [seq(i, tokens[i], 0, len(tokens[i]) - 1) for i in range(num_seqs)]
    for fam in (eager, static):
        _step(model, fam, prompt)
    for step_idx in range(10):
        rows = rng.sample(range(num_seqs), rng.randint(1, num_seqs))
        seqs = [seq(i, tokens[i], len(tokens[i]) - 1, 1) for i in rows]
        monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "0")
        want = _step(model, eager, seqs)
        monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "1")
        static.check_continuation(seqs)
        step.stage(seqs)
        static.record(seqs)
        step.begin()
        got = model(step.input_ids, step.positions, step)[: len(seqs)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step_idx}")
        for a, e in zip(static.caches, eager.caches, strict=True):
            for name, pool in a.pools.items():
                torch.testing.assert_close(pool.cache.view(torch.float32),
                                           e.pools[name].cache.view(torch.float32),
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
                for x, y in zip(a.state[name], e.state[name], strict=True):
                    # the rings (trash row aside); earlier layers' noise reaches the projections
                    torch.testing.assert_close(x[:-1], y[:-1], atol=1e-5, rtol=1e-5)
        for i, t in zip(rows, want.argmax(dim=-1).tolist(), strict=True):
            tokens[i].append(t)
    assert min(len(t) for t in tokens.values()) >= 8  # CSA windows closed in decode
    assert len(fused_calls) >= 10
