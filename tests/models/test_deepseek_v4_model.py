"""DeepSeek-V4 logits and greedy tokens against Hugging Face, through the reference family.

Each case builds a tiny random HF ``DeepseekV4ForCausalLM`` (layer orders mixing sliding, CSA
and HCA layers; windows shorter than the prompts; CSA ratio 4 and HCA ratio 8 or 16; top-k
smaller than the number of entries), saves it with ``save_pretrained``, loads it with
`load_deepseek_v4`, and holds kvplan's logits within 1e-4 of HF's full forward.
"""

from __future__ import annotations

import random

import pytest
import torch
from dsv4_testlib import hf_logits, random_tokens, run_step, saved_pair

from kvplan.backends.hybrid.reference import ReferenceHybridFamily

SEEDS = (0, 1, 2, 3)
ATOL = 1e-4


@pytest.fixture(scope="module", params=SEEDS)
def pair(request, tmp_path_factory):
    hf, model = saved_pair(tmp_path_factory.mktemp("dsv4"), request.param)
    return request.param, hf, model


def _family(model) -> ReferenceHybridFamily:
    return ReferenceHybridFamily(model.config.layer_specs())


def test_config_round_trip(pair):
    _, hf, model = pair
    cfg = model.config
    assert cfg.layer_types == tuple(hf.config.layer_types)
    assert cfg.rope_head_dim == hf.config.qk_rope_head_dim
    ratios = [spec.ratio for spec in cfg.layer_specs()]
    rates = hf.config.compress_rates
    assert ratios == [rates.get(k, 0) for k in hf.config.layer_types]


def test_one_long_prompt(pair):
    seed, hf, model = pair
    ids = random_tokens(seed, 41)
    want = hf_logits(hf, ids)
    (got,), _ = run_step(model, _family(model), [(7, ids, 0, len(ids))])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode(pair):
    seed, hf, model = pair
    rng = random.Random(seed)
    ids = random_tokens(seed + 10, 45)
    prompt_len = 37
    family, pieces, start = _family(model), [], 0
    while start < prompt_len:  # chunks of 1..9 rows: boundaries land inside windows
        n = min(rng.randint(1, 9), prompt_len - start)
        (logits,), _ = run_step(model, family, [(3, ids, start, n)])
        pieces.append(logits)
        start += n
    for q_start in range(prompt_len, len(ids)):  # decode rows
        (logits,), _ = run_step(model, family, [(3, ids, q_start, 1)])
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mixed_batch_flat_steps(pair):
    seed, hf, model = pair
    rng = random.Random(100 + seed)
    lengths = {0: 33, 1: 19, 2: 26, 3: 9}
    first_step = {0: 0, 1: 0, 2: 1, 3: 3}
    seqs = {rid: random_tokens(1000 * seed + rid, n) for rid, n in lengths.items()}
    done = dict.fromkeys(lengths, 0)
    got: dict[int, list[torch.Tensor]] = {rid: [] for rid in lengths}
    family, step = _family(model), 0
    while any(done[r] < lengths[r] for r in lengths):
        rows = []
        for rid in rng.sample(sorted(lengths), len(lengths)):  # any order inside a step
            if step >= first_step[rid] and done[rid] < lengths[rid]:
                n = 1 if done[rid] >= 12 else rng.randint(1, 7)  # prefill chunks, then decode
                rows.append((rid, seqs[rid], done[rid], min(n, lengths[rid] - done[rid])))
        if rows:
            outs, _ = run_step(model, family, rows)
            for (rid, _, _, n), logits in zip(rows, outs):
                got[rid].append(logits)
                done[rid] += n
        step += 1
    for rid, tokens in seqs.items():
        torch.testing.assert_close(torch.cat(got[rid]), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_restart_with_q_start_zero_recomputes(pair):
    seed, hf, model = pair
    ids = random_tokens(seed + 20, 30)
    family = _family(model)
    run_step(model, family, [(5, random_tokens(seed + 21, 13), 0, 13)])  # preempted work
    (a,), _ = run_step(model, family, [(5, ids, 0, 17)])
    (b,), _ = run_step(model, family, [(5, ids, 17, 13)])
    torch.testing.assert_close(torch.cat([a, b]), hf_logits(hf, ids), atol=ATOL, rtol=0)


@torch.no_grad()
def test_greedy_matches_hf_generate(pair):
    seed, hf, model = pair
    prompt = random_tokens(seed + 30, 23)
    num_new = 12
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new)[0]
    family, tokens = _family(model), list(prompt)
    (logits,), _ = run_step(model, family, [(1, tokens, 0, 10)])
    (logits,), _ = run_step(model, family, [(1, tokens, 10, len(prompt) - 10)])
    for _ in range(num_new):
        tokens.append(int(logits[-1].argmax()))
        (logits,), _ = run_step(model, family, [(1, tokens, len(tokens) - 1, 1)])
    assert tokens == want.tolist()
