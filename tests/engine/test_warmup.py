"""Engine warmup (`kvplan.engine.warmup`): it runs every kind of step, and afterwards the
engine serves exactly as one that never warmed up (outputs, sampling generator, request ids,
counters, prefix cache); a failing warmup step leaves the engine usable."""

from __future__ import annotations

import pytest

from kvplan import LLM, SamplingParams
from kvplan.engine.config import EngineConfig
from kvplan.engine.warmup import warm_up, warmup_prompt_lengths
from tests.models.dsv4_testlib import hf_config, hf_model, random_tokens

SMALL = {"device": "cpu", "block_size": 8, "max_num_batched_tokens": 32, "max_model_len": 80}


def _workload(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Greedy, engine-seeded sampled and request-seeded sampled requests; a shared prefix."""
    prompts = [random_tokens(i, n, vocab=200) for i, n in enumerate((5, 19, 45))]
    prompts.append(prompts[2][:40] + [1, 2, 3])  # reuses prompt 2's cached blocks
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, top_k=10, seed=3),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate(prompts[:3], params[:3]) + llm.generate(prompts[3:], params[3:])
    return [(o.request_id, o.token_ids, o.num_cached_prefix_tokens) for o in outs]


def test_prompt_lengths_cover_each_power_of_two_boundary():
    assert warmup_prompt_lengths(16) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16]
    assert warmup_prompt_lengths(100)[-4:] == [63, 64, 65, 100]
    assert warmup_prompt_lengths(1) == [1]
    with pytest.raises(ValueError, match="max_prompt_len must be >= 1, got -3"):
        warmup_prompt_lengths(-3)


def test_warmed_engine_serves_as_a_fresh_one():
    """Same tokens, request ids, cached-prefix counts, step and prefix-cache counters as an
    engine built without warmup (the engine-seeded sampled request proves the generator was
    restored; the shared prefix proves no throwaway prompt stayed in the prefix cache)."""
    fresh = LLM("random:tiny-llama", warmup=False, **SMALL)
    warm = LLM("random:tiny-llama", warmup=True, **SMALL)
    assert fresh.warmup_report is None
    rep = warm.warmup_report
    assert rep.num_requests > len(rep.prompt_lengths) and rep.num_steps > 2 * rep.num_requests
    assert rep.prompt_lengths == tuple(warmup_prompt_lengths(78))
    for llm in (fresh, warm):
        core = llm.engine
        assert (core._next_id, core.num_steps, core.scheduler.num_preemptions) == (0, 0, 0)
        assert tuple(llm.parts.manager.prefix_cache_stats()) == (0, 0)
        assert sum(p.num_cached_blocks for p in llm.parts.manager.pools) == 0
    got, want = _workload(warm), _workload(fresh)
    assert got == want
    assert [r[0] for r in got] == [0, 1, 2, 3] and got[3][2] == 40
    assert warm.engine.num_steps == fresh.engine.num_steps
    assert warm.parts.manager.prefix_cache_stats() == fresh.parts.manager.prefix_cache_stats()
    m = warm.parts.manager
    assert m.num_requests == 0 and m.num_free_blocks() == fresh.parts.manager.num_free_blocks()


def test_warmup_runs_every_step_kind(monkeypatch):
    """Prompt-only, mixed (a prompt joining decode rows), decode-only and chunked steps all
    run; the engine is idle afterwards."""
    llm = LLM("random:tiny-llama", warmup=False, **SMALL)
    core = llm.engine
    kinds, contexts = [], []
    step = core.scheduler.schedule

    def schedule():
        batch = step()
        contexts.append(batch.num_contexts)
        return batch

    monkeypatch.setattr(core.scheduler, "schedule", schedule)
    orig = core.step

    def recorded():
        out = orig()
        kinds.append(core.last_step_kind)
        return out

    monkeypatch.setattr(core, "step", recorded)
    rep = warm_up(core, vocab_size=core.vocab_size)
    assert {"prefill", "mixed", "decode"} <= set(kinds)
    assert rep.num_steps == len(kinds)
    assert not core.has_unfinished() and not core.requests
    assert min(contexts) == 0 and max(contexts) >= 1
    # prompts above the budget (32) run in chunks: 33, 63, 64, 65 and 78 tokens
    lengths = [len(r.prompt_token_ids) for r in _finished_prompts(llm, monkeypatch)]
    assert {33, 63, 64, 65, 78} <= set(lengths)


def _finished_prompts(llm: LLM, monkeypatch) -> list:
    """Run a warmup again, collecting the requests it added."""
    core, added = llm.engine, []
    add = core.add_request

    def record(ids, params):
        req = add(ids, params)
        added.append(req)
        return req

    monkeypatch.setattr(core, "add_request", record)
    warm_up(core, vocab_size=core.vocab_size)
    assert all(r.finished for r in added)
    assert all(r.finish_reason == "length" for r in added)
    return added


def test_failed_warmup_step_leaves_the_engine_usable(monkeypatch):
    llm = LLM("random:tiny-llama", warmup=False, **SMALL)
    core = llm.engine
    want = LLM("random:tiny-llama", warmup=False, **SMALL).generate([[4, 5, 6]])[0].token_ids
    calls = {"n": 0}
    forward = core.runner.execute

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("injected step failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(core.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected step failure"):
        warm_up(core, vocab_size=core.vocab_size)
    assert not core.requests and not core.has_unfinished()
    assert (core._next_id, core.num_steps) == (0, 0)
    assert llm.parts.manager.num_requests == 0
    monkeypatch.setattr(core.runner, "execute", forward)
    out = llm.generate([[4, 5, 6]])[0]
    assert out.request_id == 0 and out.token_ids == want


def test_warmup_needs_an_idle_engine():
    llm = LLM("random:tiny-llama", warmup=False, **SMALL)
    llm.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(llm.engine, vocab_size=llm.engine.vocab_size)
    with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
        warm_up(LLM("random:tiny-llama", warmup=False, **SMALL).engine, vocab_size=0)


def test_warmup_setting_is_checked():
    with pytest.raises(TypeError, match="warmup must be a bool or None, got 'yes'"):
        EngineConfig(warmup="yes")
    assert EngineConfig(device="cpu").warmup_on is False
    assert EngineConfig(device="cpu", warmup=True).warmup_on is True


def test_warmed_deepseek_v4_engine_serves_as_a_fresh_one(tmp_path):
    """The hybrid family (compressor state slots, ring, no prefix cache): after a warmup the
    greedy and sampled tokens equal a fresh engine's."""
    hf = hf_model(hf_config(2), 2)
    hf.save_pretrained(tmp_path / "m")
    kw = {"device": "cpu", "max_num_batched_tokens": 16, "max_model_len": 48, "max_num_seqs": 3}
    prompts = [random_tokens(50 + i, n) for i, n in enumerate((7, 21, 30))]
    params = [SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8),
              SamplingParams(max_tokens=5, ignore_eos=True)]  # fmt: skip
    outs = {}
    for warm in (False, True):
        llm = LLM(str(tmp_path / "m"), warmup=warm, **kw)
        res = llm.generate(prompts, params)
        outs[warm] = [(o.request_id, o.token_ids) for o in res]
        assert llm.parts.manager.num_requests == 0
    assert outs[True] == outs[False]


def test_warmup_verifies_drafts_with_speculative_decoding(monkeypatch):
    """With n-gram drafts on, the warmup runs decode rows with drafts to verify (several query
    tokens a row) even when no n-gram matches, puts the proposer back, and a warmed engine's
    greedy tokens equal a fresh one's."""
    kw = {**SMALL, "num_speculative_tokens": 3}
    llm = LLM("random:tiny-llama", warmup=False, **kw)
    core = llm.engine
    proposed = []

    def no_match(req):  # the n-gram proposer finding nothing: phase 5 still verifies drafts
        proposed.append(req.request_id)
        return []

    monkeypatch.setattr(core.scheduler, "propose_drafts", no_match)
    verified = []
    execute = core.runner.execute

    def record(step, *args):
        verified.extend(len(seq.drafts) for seq in step.seqs)
        return execute(step, *args)

    monkeypatch.setattr(core.runner, "execute", record)
    warm_up(core, vocab_size=core.vocab_size)
    assert proposed and max(verified) == 3  # decode rows with 3 drafts each
    assert core.scheduler.propose_drafts is no_match  # put back
    prompts = [[5, 6, 7] * 6, random_tokens(9, 30, vocab=200)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    fresh = LLM("random:tiny-llama", warmup=False, **kw).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh]
    assert [o.request_id for o in got] == [0, 1]


def test_failing_warmup_fails_construction_clearly(monkeypatch):
    """A warmup step that raises makes `LLM(...)` raise a RuntimeError that names the warmup
    and the way to skip it, chained to the step's error."""
    from kvplan.engine import warmup as wm

    step = wm._Driver.step
    calls = {"n": 0}

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise ValueError("injected")
        step(self)

    monkeypatch.setattr(wm._Driver, "step", failing)
    with pytest.raises(RuntimeError, match=r"engine warmup failed \(ValueError: injected\)") as e:
        LLM("random:tiny-llama", warmup=True, **SMALL)
    assert "warmup=False" in str(e.value) and isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_seqs": 1},
        {"enable_chunked_prefill": False},
        {"max_model_len": 8, "max_num_batched_tokens": 4},
        {"max_model_len": 3},
        {"backend": "ragged", "num_blocks": 11},  # one max-length sequence: prompts queue
    ],
    ids=["one_seq", "no_chunking", "tiny_len", "len_3", "small_pool"],
)
def test_warmup_fits_any_engine_shape(settings):
    """Small or restricted engines warm up without error and then serve like fresh ones."""
    kw = {**SMALL, **settings}
    warm = LLM("random:tiny-llama", warmup=True, **kw)
    fresh = LLM("random:tiny-llama", warmup=False, **kw)
    prompt = [3, 1, 4, 1][: max(1, kw["max_model_len"] - 2)]
    params = SamplingParams(max_tokens=min(4, kw["max_model_len"] - len(prompt)), ignore_eos=True)
    got, want = warm.generate([prompt], params)[0], fresh.generate([prompt], params)[0]
    assert (got.request_id, got.token_ids) == (want.request_id, want.token_ids)
    assert warm.parts.manager.num_requests == 0
