"""Logprobs of sampled tokens and prompt tokens (`SamplingParams.logprobs` /
``prompt_logprobs``) against ``log_softmax`` of a random Hugging Face Llama's logits over the
same sequence (fp32, CPU)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_models import make_hf_model, random_prompts

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.engine.scoring import prompt_logits

LLM = partial(_LLM, device="cpu", block_size=8, max_model_len=128)
ATOL = 1e-5  # fp32: logprobs agree to 1e-5, absolute or relative
RTOL = 1e-5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(model folder, HF model) of a random Llama."""
    model = make_hf_model("llama", seed=11)
    folder = tmp_path_factory.mktemp("llama_lp")
    model.save_pretrained(str(folder))
    return str(folder), model


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """fp32 ``[len(ids), V]``: row p is log_softmax of the logits after ``ids[: p + 1]``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_entry(entry, token: int, row: torch.Tensor, k: int) -> None:
    """``entry`` is token's logprob under ``row`` with the top-k of ``row``, sorted."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL, rel=RTOL)
    assert len(entry.top) == k
    values = [lp for _, lp in entry.top]
    assert values == sorted(values, reverse=True)
    ref_vals, ref_ids = row.topk(k)
    assert [t for t, _ in entry.top] == ref_ids.tolist()
    assert values == pytest.approx(ref_vals.tolist(), abs=ATOL, rel=RTOL)
    for t, lp in entry.top:
        assert lp == pytest.approx(float(row[t]), abs=ATOL, rel=RTOL)


def check_output(model, out, k: int | None, prompt_k: int | None) -> None:
    ids = out.prompt_token_ids + out.token_ids
    ref = ref_logprobs(model, ids)
    n = len(out.prompt_token_ids)
    if k is None:
        assert out.logprobs is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            check_entry(entry, token, ref[n - 1 + j], k)
    if prompt_k is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
        for i in range(1, n):
            check_entry(out.prompt_logprobs[i], ids[i], ref[i - 1], prompt_k)


@pytest.mark.parametrize("budget", [16, 128], ids=["chunked", "whole"])
def test_greedy_logprobs_match_hf(hf, budget):
    folder, model = hf
    llm = LLM(folder, max_num_batched_tokens=budget, enable_chunked_prefill=budget < 128)
    prompts = random_prompts(5, 3, 40, 256, seed=1)
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k) for k in (5, 0, None, 20, 3)
    ]
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # logprobs change nothing
    for out, p in zip(outs, params):
        check_output(model, out, p.logprobs, None)
        for e in out.logprobs or []:  # greedy: the chosen token is the most likely one
            assert not e.top or e.top[0][0] == e.token_id


def test_sampled_logprobs_are_of_the_raw_distribution(hf):
    folder, model = hf
    llm = LLM(folder, max_num_batched_tokens=16)
    prompts = random_prompts(4, 5, 30, 256, seed=2)
    kw = dict(max_tokens=10, ignore_eos=True, temperature=1.3, top_k=40, top_p=0.9)
    params = [SamplingParams(seed=i, logprobs=4, **kw) for i in range(4)]
    outs = llm.generate(prompts, params)
    again = llm.generate(prompts, [SamplingParams(seed=i, **kw) for i in range(4)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    for out in outs:
        check_output(model, out, 4, None)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_chunked(hf, prefix_caching):
    folder, model = hf
    llm = LLM(folder, max_num_batched_tokens=8, enable_prefix_caching=prefix_caching)
    prompt = random_prompts(1, 37, 37, 256, seed=3)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=2))[0]  # fills the prefix cache
    assert first.prompt_logprobs is None
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=4, logprobs=2)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_prefix_tokens == 0  # every prompt position was computed
    check_output(model, out, 2, 4)
    # against the engine's own teacher-forced logits too
    ref = prompt_logits(llm.engine, prompt, chunk_size=5).log_softmax(-1)
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1


def test_logprobs_with_preemption(hf):
    folder, model = hf
    llm = LLM(folder, block_size=4, num_blocks=24, max_num_batched_tokens=16, max_model_len=64)
    prompts = random_prompts(8, 10, 20, 256, seed=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for out in outs:
        check_output(model, out, 3, 1)


def test_stream_logprobs_equal_generate(hf):
    folder, _ = hf
    llm = LLM(folder, max_num_batched_tokens=16)
    prompt = random_prompts(1, 20, 20, 256, seed=5)[0]
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = llm.generate([prompt], params)[0]
    deltas = list(llm.generate_stream(prompt, params))
    assert deltas[0].prompt_logprobs == want.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert [e for d in deltas for e in d.logprobs] == want.logprobs
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)


def test_async_and_speculative_steps(hf):
    folder, model = hf
    prompts = random_prompts(4, 8, 24, 256, seed=6)
    prompts[0] = prompts[0][:4] * 5  # repetitive: n-gram drafts get proposed
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, logprobs=k)
        for n, k in ((16, 2), (24, None), (6, 1), (24, None))
    ]
    base = LLM(folder).generate(prompts, params)
    for kw in (dict(async_scheduling=True), dict(num_speculative_tokens=3)):
        llm = LLM(folder, **kw)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        for out, p in zip(outs, params):
            check_output(model, out, p.logprobs, None)
        if "async_scheduling" in kw:  # launched ahead once no logprobs row is left
            assert llm.engine.num_steps_ahead > 0
    # verification rows: drafts were proposed for the logprobs request
    core = LLM(folder, num_speculative_tokens=3).engine
    reqs = [core.add_request(ids, p) for ids, p in zip(prompts, params)]
    while core.has_unfinished():
        core.step()
    assert reqs[0].num_draft_tokens_proposed > 0
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in base]
    assert [len(r.logprobs) for r in reqs] == [16, 0, 6, 0]


def test_params_validation():
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 21})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: -1})
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: True})
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: 1.0})
    assert SamplingParams(logprobs=0, prompt_logprobs=20).logprobs == 0
