"""Repetition / frequency / presence penalties and logit bias: the sampler against a per-token
loop and Hugging Face's logits processors, the engine's greedy output against HF ``generate``
(``repetition_penalty``, ``sequence_bias``) and against a per-token loop over HF's model
(frequency / presence penalties), and the checks on bad values (CPU, fp32)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_models import make_hf_model, random_prompts

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.engine.sampling import (
    apply_penalties,
    apply_penalties_rows,
    prompt_token_mask,
    sample,
)

LLM = partial(_LLM, device="cpu")


def _adjust_loop(row: list[float], p: SamplingParams, prompt: list[int], out: list[int]):
    """The module docstring's rules, token by token on Python floats."""
    row = list(row)
    for t in set(prompt) | set(out):
        r = p.repetition_penalty
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias:
        row[t] += b
    return row


CASES = [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=-1.5),
    dict(frequency_penalty=-0.4, presence_penalty=2.0, repetition_penalty=1.2),
    dict(logit_bias={3: 100.0, 7: -100, 11: 2.5}),
    dict(logit_bias={5: -3.0}, repetition_penalty=1.3, frequency_penalty=0.5),
]


@pytest.mark.parametrize("kw", CASES)
def test_apply_penalties_matches_loop(kw):
    g = torch.Generator().manual_seed(len(str(kw)))
    vocab = 40
    logits = torch.randn(vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
    out = torch.randint(0, vocab, (14,), generator=g).tolist()  # repeats some tokens
    p = SamplingParams(**kw)
    before = logits.clone()
    got = apply_penalties(logits, p, prompt, out)
    assert torch.equal(logits, before)  # the input row is not written
    want = torch.tensor(_adjust_loop(logits.tolist(), p, prompt, out))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_batched_rows_equal_each_row_and_take_prompt_masks():
    """All rows at once (padded ids, one scatter per kind) equal each row alone, with the
    prompt given as ids or as its token mask; rows without an adjustment come back as
    they were."""
    g = torch.Generator().manual_seed(9)
    vocab = 40
    logits = torch.randn(len(CASES) + 1, vocab, generator=g) * 3
    params = [SamplingParams(**kw) for kw in CASES] + [SamplingParams()]
    hist = []
    for i in range(len(params)):
        n = i % 4 * 5  # empty outputs too
        hist.append((torch.randint(0, vocab, (3 + i,), generator=g).tolist(),
                     torch.randint(0, vocab, (n,), generator=g).tolist()))  # fmt: skip
    got = apply_penalties_rows(logits, params, hist)
    masks = [(prompt_token_mask(p, vocab, "cpu"), o) for p, o in hist]
    assert torch.equal(apply_penalties_rows(logits, params, masks), got)
    for i, p in enumerate(params):
        assert torch.equal(got[i], apply_penalties(logits[i], p, *hist[i]))
        want = torch.tensor(_adjust_loop(logits[i].tolist(), p, *hist[i]))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[-1], logits[-1])


def test_repetition_penalty_equals_hf_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g) * 2
    for i in range(4):
        seq = torch.randint(0, 30, (1, 12), generator=g)
        for r in (0.5, 1.3, 2.0):
            want = RepetitionPenaltyLogitsProcessor(r)(seq, logits[i : i + 1].clone())[0]
            got = apply_penalties(logits[i], SamplingParams(repetition_penalty=r),
                                  seq[0, :5].tolist(), seq[0, 5:].tolist())  # fmt: skip
            assert torch.equal(got, want)


def test_sample_mixes_plain_and_adjusted_rows():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=g)
    keep = logits.clone()
    params = [
        SamplingParams(),  # plain greedy
        SamplingParams(logit_bias={int(logits[1].argmin()): 100.0}),  # forced token
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(temperature=0.7, seed=1, presence_penalty=1.0),
    ]
    hist = [None, ([1, 2], []), ([3], [int(logits[2].argmax())] * 3), ([4], [9, 9])]
    gens = [None, None, None, torch.Generator().manual_seed(1)]
    got = sample(logits, params, gens, None, hist)
    assert torch.equal(logits, keep)  # the logprobs read these afterwards
    assert int(got[0]) == int(logits[0].argmax())
    assert int(got[1]) == int(logits[1].argmin())
    adj = torch.tensor(_adjust_loop(logits[2].tolist(), params[2], *hist[2]))
    assert int(got[2]) == int(adj.argmax()) != int(logits[2].argmax())
    # the sampled row equals sampling its adjusted logits alone with the same seed
    alone = sample(apply_penalties(logits[3], params[3], *hist[3])[None],
                   [SamplingParams(temperature=0.7)], [torch.Generator().manual_seed(1)])  # fmt: skip
    assert int(got[3]) == int(alone[0])
    with pytest.raises(ValueError, match="histories"):
        sample(logits, params, gens, None)


def test_params_checks_name_the_field():
    assert not SamplingParams(frequency_penalty=0.1).greedy
    assert not SamplingParams(logit_bias={1: 0.5}).greedy
    assert SamplingParams(presence_penalty=0, repetition_penalty=1).greedy
    assert SamplingParams(logit_bias={9: 1, 2: -1.5}).logit_bias == ((2, -1.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(4, 2)]).logit_bias == ((4, 2.0),)
    bad = [
        (dict(presence_penalty=2.5), ValueError, "presence_penalty must be in"),
        (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty must be finite"),
        (dict(frequency_penalty="1"), TypeError, "frequency_penalty must be a float"),
        (dict(repetition_penalty=0), ValueError, "repetition_penalty must be > 0"),
        (dict(logit_bias={-1: 1.0}), ValueError, "token ids must be ints >= 0, got -1"),
        (dict(logit_bias={"3": 1.0}), ValueError, "token ids must be ints >= 0, got '3'"),
        (dict(logit_bias={3: 101}), ValueError, r"logit_bias\[3\] must be in"),
        (dict(logit_bias={3: None}), TypeError, r"logit_bias\[3\] must be a float"),
        (dict(logit_bias=[(3, 1), (3, 2)]), ValueError, "token id 3 is given twice"),
        (dict(logit_bias=5), TypeError, "logit_bias must be a mapping"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model("llama", seed=11)
    folder = tmp_path_factory.mktemp("pen")
    hf.save_pretrained(str(folder))
    prompts = random_prompts(4, 3, 20, hf.config.vocab_size, seed=4)
    return hf, str(folder), prompts


NEW = 20


def _hf_generate(hf, prompt, **kw):
    gen_cfg = hf.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt])  # an explicit mask: a prompt may hold the pad id 0
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, **kw)  # fmt: skip
    finally:
        gen_cfg.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def _hf_loop(hf, prompt, p: SamplingParams):
    """Greedy decoding over HF's full forward with `_adjust_loop` on each step's logits."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.tensor([prompt + out], device=hf.device)
            logits = hf(ids).logits[0, -1].tolist()
            row = _adjust_loop(logits, p, prompt, out)
            out.append(max(range(len(row)), key=lambda i: (row[i], -i)))
    return out


def test_engine_repetition_penalty_and_bias_equal_hf_generate(tiny):
    hf, folder, prompts = tiny
    llm = LLM(folder, block_size=8, max_num_batched_tokens=16, max_model_len=64)
    bias = {int(t): -100.0 for t in range(0, hf.config.vocab_size, 3)}  # ban every third id
    plain = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
    rep = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                               repetition_penalty=1.8))  # fmt: skip
    biased = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                  logit_bias=bias))  # fmt: skip
    changed = 0
    for i, pr in enumerate(prompts):
        assert rep[i].token_ids == _hf_generate(hf, pr, repetition_penalty=1.8)
        want = _hf_generate(hf, pr, sequence_bias={(t,): b for t, b in bias.items()})
        assert biased[i].token_ids == want and all(t % 3 for t in want)
        changed += rep[i].token_ids != plain[i].token_ids
    assert changed  # the penalty changed some outputs (the test can fail)
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1


def test_engine_frequency_presence_equal_loop_in_a_mixed_batch(tiny):
    hf, folder, prompts = tiny
    llm = LLM(folder, block_size=8, max_num_batched_tokens=16, max_model_len=64,
              num_speculative_tokens=2)  # fmt: skip
    pen = [SamplingParams(max_tokens=NEW, ignore_eos=True, frequency_penalty=1.5),
           SamplingParams(max_tokens=NEW, ignore_eos=True, presence_penalty=2.0),
           SamplingParams(max_tokens=NEW, ignore_eos=True),  # plain rows share the steps
           SamplingParams(max_tokens=NEW, ignore_eos=True, frequency_penalty=-0.5,
                          presence_penalty=0.5, repetition_penalty=1.1)]  # fmt: skip
    outs = llm.generate(prompts, pen)
    for i, pr in enumerate(prompts):
        assert outs[i].token_ids == _hf_loop(hf, pr, pen[i]), i
    assert len(set(outs[1].token_ids)) > len(set(_hf_loop(hf, prompts[1], pen[2])))


def test_engine_refuses_bias_outside_the_vocabulary(tiny):
    hf, folder, prompts = tiny
    llm = LLM(folder, block_size=8, max_model_len=64)
    v = hf.config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: token id {v} is outside the vocabulary"):
        llm.engine.add_request(prompts[0], SamplingParams(logit_bias={v: 1.0}))
    assert not llm.engine.has_unfinished()


def test_async_scheduling_with_penalized_requests_equals_sync(tiny):
    """Async scheduling launches only all-greedy decode steps ahead: a penalized request in
    the batch makes its steps synchronous, and the outputs equal the synchronous engine's."""
    hf, folder, prompts = tiny
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(max_tokens=NEW, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={7: 5.0}),
              SamplingParams(max_tokens=NEW, ignore_eos=True)]  # fmt: skip
    outs = []
    for on in (False, True):
        llm = LLM(folder, block_size=8, max_num_batched_tokens=16, max_model_len=64,
                  async_scheduling=on)  # fmt: skip
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert outs[0][0] == _hf_loop(hf, prompts[0], params[0])


def test_cli_generate_takes_the_penalties(tiny, capsys):
    from kvplan.cli import main

    hf, folder, prompts = tiny
    argv = ["generate", "--model", folder, "--device", "cpu", "--max-tokens", str(NEW),
            "--token-ids", ",".join(map(str, prompts[1]))]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--repetition-penalty", "1.8"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    assert got == _hf_generate(hf, prompts[1], repetition_penalty=1.8)
    assert main([*argv, "--frequency-penalty", "1.5"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    assert got == _hf_loop(hf, prompts[1], SamplingParams(frequency_penalty=1.5))
    assert main([*argv, "--presence-penalty", "3"]) == 2
    assert "presence_penalty must be in [-2.0, 2.0], got 3.0" in capsys.readouterr().err


@pytest.mark.gpu
def test_penalized_requests_on_cuda_equal_the_loop(tiny):
    """On CUDA (fp32 weights, CUDA graphs and async scheduling on by default), penalized and
    biased requests in one batch with plain greedy ones: the penalized tokens equal the
    per-token loop over HF's model on the same device."""
    import copy

    hf, folder, prompts = tiny
    hf = copy.deepcopy(hf).cuda()
    llm = _LLM(folder, device="cuda", dtype="float32", block_size=8, max_model_len=64)
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=NEW, ignore_eos=True),
              SamplingParams(max_tokens=NEW, ignore_eos=True, frequency_penalty=1.0,
                             presence_penalty=0.5, logit_bias={7: 2.0}),
              SamplingParams(max_tokens=NEW, ignore_eos=True)]  # fmt: skip
    outs = llm.generate(prompts, params)
    for i, pr in enumerate(prompts):
        assert outs[i].token_ids == _hf_loop(hf, pr, params[i]), i


def test_min_tokens_equals_hf_min_new_tokens(tmp_path):
    """``min_tokens``: EOS (and stop token ids) cannot end a request before that many tokens,
    as HF ``generate(min_new_tokens=)``; without it the same EOS ends the request at once."""
    hf = make_hf_model("llama", seed=12)
    prompts = random_prompts(3, 4, 12, hf.config.vocab_size, seed=8)
    eos = _hf_first_tokens(hf, prompts[0])[1]  # the second greedy token of the first prompt
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), block_size=8, max_model_len=64)
    short = llm.generate(prompts[:1], SamplingParams(max_tokens=NEW))[0]
    assert short.token_ids[-1] == eos and len(short.token_ids) == 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, min_tokens=8))
    for pr, o in zip(prompts, outs):
        ids = torch.tensor([pr])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                               min_new_tokens=8, do_sample=False, pad_token_id=0)  # fmt: skip
        want = want[0, len(pr) :].tolist()
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert o.token_ids == want
        assert len(o.token_ids) >= 8 and eos not in o.token_ids[:7]
    # a stop token id is held back the same way
    stop = llm.generate(prompts[:1], SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                    stop_token_ids=[eos], min_tokens=5))  # fmt: skip
    assert eos not in stop[0].token_ids[:5] and len(stop[0].token_ids) >= 5
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def _hf_first_tokens(hf, prompt):
    """HF's greedy continuation of ``prompt``, 4 tokens, no EOS."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                          min_new_tokens=4, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
