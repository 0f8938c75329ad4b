"""DeepSeek-V4 end to end on the planned hybrid family (kvplan's planning layer, paged storage
and index ops) against Hugging Face.

Tiny random HF models (`dsv4_testlib.hf_config`: layer orders mixing sliding, CSA and HCA
layers, windows 5-8 shorter than the prompts, CSA ratio 4 and HCA ratio 8 or 16, top-k 2-3
of up to 11 entries, 8 indexer heads) run through `PlannedRunner`, which hands out block
tables (block 0 reserved) and state slots like an engine. Exact rows: logits within 1e-4 of
HF's full forward, greedy tokens identical to HF's ``generate``, and every query row's
attended set (named from the rows the family gathered) equal to HF's hooked masks. FP8 / FP4:
logits within 1e-4 of HF whose stored rows pass through the same quantize-dequantize.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from dsv4_planned_testlib import PlannedRunner, quantized_hf
from dsv4_testlib import hf_config, hf_logits, random_tokens, saved_pair
from test_deepseek_v4_visibility import _hf_visible

from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random

SEEDS = (0, 1, 2)
ATOL = 1e-4
CSA = "compressed_sparse_attention"


@pytest.fixture(scope="module", params=SEEDS)
def pair(request, tmp_path_factory):
    hf, model = saved_pair(tmp_path_factory.mktemp("dsv4p"), request.param)
    return request.param, hf, model


def _close(got: list[torch.Tensor], hf, ids: list[int]) -> None:
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_one_long_prompt_then_decode(pair):
    seed, hf, model = pair
    ids = random_tokens(seed, 47)
    run = PlannedRunner(model)
    got, _ = run.step([(0, ids, 0, 41)])
    for q_start in range(41, len(ids)):
        got += run.step([(0, ids, q_start, 1)])[0]
    _close(got, hf, ids)


def test_chunked_prefill_sees_what_hf_sees(pair):
    """Chunks of 1-7 rows (boundaries inside compression windows), then decode rows; every
    row of every layer attends exactly HF's visible set."""
    seed, hf, model = pair
    ids = random_tokens(seed + 40, 45)
    rng = random.Random(seed)
    run = PlannedRunner(model, trace=True)
    got, seen = [], [[] for _ in model.layers]
    start = 0
    while start < len(ids):
        n = 1 if start >= 38 else min(rng.randint(1, 7), 38 - start)
        logits, visible = run.step([(0, ids, start, n)])
        got += logits
        for layer, rows in visible.items():
            seen[layer] += rows
        start += n
    _close(got, hf, ids)
    want = _hf_visible(hf, ids)
    for layer, spec in enumerate(model.config.layer_specs()):
        assert seen[layer] == want[layer], f"layer {layer} ({spec.kind})"
        if spec.kind == CSA:  # the top-k really selects
            picked = [j for kind, j in seen[layer][-1] if kind == "compressed"]
            assert len(picked) == spec.top_k < len(ids) // spec.ratio


def test_mixed_batch_flat_steps(pair):
    """Prefill chunks and decode rows of four requests of different lengths in one flat step;
    each request's rows see exactly HF's visible sets of that request alone."""
    seed, hf, model = pair
    rng = random.Random(100 + seed)
    lengths = {0: 33, 1: 19, 2: 26, 3: 17}  # >= 16: HF passes no mask to shorter inputs
    first_step = {0: 0, 1: 0, 2: 1, 3: 3}
    seqs = {rid: random_tokens(1000 * seed + rid, n) for rid, n in lengths.items()}
    done = dict.fromkeys(lengths, 0)
    got: dict[int, list[torch.Tensor]] = {rid: [] for rid in lengths}
    seen = {rid: [[] for _ in model.layers] for rid in lengths}
    builder = ("eager", "device")[seed % 2]  # decode-only steps: both decode builders
    run, step, mixed = PlannedRunner(model, trace=True, decode_builder=builder), 0, 0
    while any(done[r] < lengths[r] for r in lengths):
        rows = []
        for rid in rng.sample(sorted(lengths), len(lengths)):
            if step >= first_step[rid] and done[rid] < lengths[rid]:
                n = 1 if done[rid] >= 12 else rng.randint(1, 7)
                rows.append((rid, seqs[rid], done[rid], min(n, lengths[rid] - done[rid])))
        if rows:
            outs, visible = run.step(rows)
            mixed += len({n > 1 for *_, n in rows}) == 2
            t = 0
            for (rid, _, _, n), logits in zip(rows, outs, strict=True):
                got[rid].append(logits)
                for layer, sets in visible.items():
                    seen[rid][layer] += sets[t : t + n]
                done[rid] += n
                t += n
        step += 1
    assert mixed > 0
    for rid, tokens in seqs.items():
        _close(got[rid], hf, tokens)
        assert seen[rid] == _hf_visible(hf, tokens), f"request {rid}"


def test_preemption_recomputes(pair):
    """A request preempted mid-prompt restarts with ``q_start == 0`` in another state slot after
    a new request took (and wrote) its old slot and blocks; another restarts in its own slot."""
    seed, hf, model = pair
    a, b, c = (random_tokens(seed + 50 + k, n) for k, n in enumerate((30, 25, 21)))
    run = PlannedRunner(model)
    run.step([(0, a, 0, 13)])
    run.step([(0, a, 13, 4), (1, b, 0, 6)])
    old_slot, old_table = run.slots[0], run.tables[0]
    run.preempt(0)
    (first_c, _), _ = run.step([(2, c, 0, 11), (1, b, 6, 6)])  # c takes a's slot and blocks
    got_a, got_b, got_c = [], [], [first_c]
    assert (run.slots[2], run.tables[2]) == (old_slot, old_table)
    for start, n in ((0, 9), (9, 14), (23, 7)):  # a recomputed from scratch, elsewhere
        (la, lc), _ = run.step([(0, a, start, n), (2, c, 11 + start // 9, 1)])
        got_a.append(la)
        got_c.append(lc)
    assert run.slots[0] != old_slot
    got_b += run.step([(1, b, 0, 20)])[0]  # b restarts in its own slot, no free()
    got_b += run.step([(1, b, 20, 5)])[0]
    _close(got_a, hf, a)
    _close(got_b, hf, b)
    _close(got_c, hf, c[:14])


@torch.no_grad()
def test_greedy_matches_hf_generate(pair):
    """Decode steps planned by ``prepare_decode_on_device`` (its torch path on the CPU)."""
    seed, hf, model = pair
    prompt = random_tokens(seed + 30, 23)
    num_new = 12
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new)[0]
    run, tokens = PlannedRunner(model, decode_builder="device"), list(prompt)
    run.step([(1, tokens, 0, 10)])
    (logits,), _ = run.step([(1, tokens, 10, len(prompt) - 10)])
    for _ in range(num_new):
        tokens.append(int(logits[-1].argmax()))
        (logits,), _ = run.step([(1, tokens, len(tokens) - 1, 1)])
    assert tokens == want.tolist()


# (kv_format, index format, head_dim, index_head_dim): widths 32 give every layout whole scale
# groups; 512 / 128 are the real widths, where the layouts are V41 / V41_FP4 / the index formats
QUANTIZED = [
    ("fp8", "mxfp8", 32, 32),
    ("fp8", "fp8_fp32sf", 32, 32),
    ("fp8", "fp4", 32, 32),
    ("fp4", None, 32, 32),
    ("fp8", "fp8_fp32sf", 512, 128),
    ("fp4", "mxfp8", 512, 128),
]


@pytest.mark.parametrize("case", range(len(QUANTIZED)))
def test_quantized_equals_hf_with_quantized_rows(tmp_path, case):
    """Two requests (chunked prefill next to decode rows). The quantized logits are far from
    the exact ones, equal to HF's whose raw rows, compressed entries and indexer keys (equal
    to the model's within fp32 noise, then replaced by them) pass through the same
    quantize-dequantize."""
    kv_format, index_kind, width, index_width = QUANTIZED[case]
    hf, model = saved_pair(tmp_path, 3 + case, head_dim=width, index_head_dim=index_width,
                           partial_rotary_factor=16 / width if width < 128 else 64 / width)  # fmt: skip
    a, b = random_tokens(case, 37), random_tokens(case + 9, 20)
    rng = random.Random(case)
    run = PlannedRunner(model, kv_format=kv_format, index_format=index_kind)
    got_a, got_b = [], run.step([(1, b, 0, 12)])[0]
    start, b_done = 0, 12
    while start < len(a) or b_done < len(b):
        rows = []
        if start < len(a):
            rows.append((0, a, start, min(rng.randint(1, 7), len(a) - start)))
        if b_done < len(b):
            rows.append((1, b, b_done, 1))
        for (rid, _, _, n), logits in zip(rows, run.step(rows)[0], strict=True):
            (got_a if rid == 0 else got_b).append(logits)
            start, b_done = (start + n, b_done) if rid == 0 else (start, b_done + 1)
    exact = hf_logits(hf, a)
    for rid, got, ids in ((0, got_a, a), (1, got_b, b)):
        with quantized_hf(hf, kv_format, index_kind, partial(run.stored, rid)):
            _close(got, hf, ids)
    assert (torch.cat(got_a) - exact).abs().max() > 1e-2


@pytest.mark.parametrize("seed", [0, 1])
def test_quantized_quality_against_exact(seed):
    """Teacher-forced 256 tokens (4 chunks of 64) on a random model (`init_random`, std 0.02):
    fp8 keeps >= 90% top-1 agreement with the exact cache and beats fp4 (loose bounds; the
    figures for the README come from ``bench/dsv4_kv_quality.py``)."""
    hf_cfg = hf_config(seed, head_dim=32, index_head_dim=32, vocab_size=256)
    model = init_random(DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_cfg)).eval(), seed=seed)
    ids = random_tokens(seed, 256, vocab=256)
    logits = {}
    for kv_format in ("exact", "fp8", "fp4"):
        run = PlannedRunner(model, kv_format=kv_format, max_model_len=256, num_state_slots=1)
        logits[kv_format] = torch.cat(
            [run.step([(0, ids, s, 64)])[0][0] for s in range(0, 256, 64)]
        )
    exact, figures = logits["exact"], {}
    for kv_format in ("fp8", "fp4"):
        got = logits[kv_format]
        rel = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
        top1 = float((got.argmax(-1) == exact.argmax(-1)).float().mean())
        figures[kv_format] = (top1, float(rel.mean()), float(rel.max()))
        print(f"seed {seed} {kv_format}: top-1 {top1:.3f}, relative logit error mean "
              f"{rel.mean():.4f} max {rel.max():.4f}")  # fmt: skip
    assert figures["fp8"][0] >= 0.9 and figures["fp4"][0] >= 0.7
    assert 0 < figures["fp8"][1] < figures["fp4"][1] < 0.25
