"""Engine reliability: bad requests are refused whole, failed steps free their requests, no
stuck scheduler, thread-safe `LLM`, early-closed streams abort, and a fuzz of all of these
that checks the block ledger after every operation."""

from __future__ import annotations

import math
import pathlib
import random
import threading

import pytest

from kvplan import LLM, SamplingParams
from kvplan.engine.request import RequestStatus

VOCAB = 512  # tiny-llama


def make_llm(**kw) -> LLM:
    settings = dict(device="cpu", backend="vanilla", block_size=4, max_model_len=64)
    settings.update(kw)
    return LLM("random:tiny-llama", **settings)


def check_ledger(llm: LLM) -> None:
    """In every block pool (a sliding layer's beside the global one), free blocks + blocks
    held by live requests == pool size; only running requests hold blocks."""
    core = llm.engine
    m = core.scheduler.manager
    for p, pool in enumerate(m.pools):
        held = {b for rid in m.request_ids() for b in m.get_block_ids(rid, p) if b}
        assert pool.num_free_blocks + len(held) == pool.num_blocks - 1, f"pool {p} lost blocks"
    running = {r.request_id for r in core.scheduler.running}
    assert set(m.request_ids()) == running
    assert all(r.status is RequestStatus.RUNNING for r in core.scheduler.running)
    assert all(r.status is RequestStatus.WAITING for r in core.scheduler.waiting)


def all_free(llm: LLM) -> bool:
    m = llm.engine.scheduler.manager
    return not m.request_ids() and m.pools[0].num_free_blocks == llm.parts.num_blocks - 1


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(max_num_batched_tokens=32, enable_chunked_prefill=False)


@pytest.mark.parametrize(
    "prompt, exc, match",
    [
        ([1, 2.0, 3], TypeError, r"prompt_token_ids\[1\]"),
        ([1, True], TypeError, r"prompt_token_ids\[1\]"),
        ([1, -1], ValueError, r"prompt_token_ids\[1\]=-1"),
        ([VOCAB], ValueError, r"prompt_token_ids\[0\]=512 is outside"),
        ([3, 4, 5, 6, False], TypeError, r"prompt_token_ids\[4\]"),  # the first bad one
        ([3, 4, 5, VOCAB + 7, -2], ValueError, r"prompt_token_ids\[3\]=519"),
        ([], ValueError, "empty"),
        ([1] * 60, ValueError, "max_model_len"),
        ([1] * 40, ValueError, "max_num_batched_tokens"),
    ],
)
def test_bad_request_refused_and_leaves_nothing(llm, prompt, exc, match):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    with pytest.raises(exc, match=match):
        llm.generate([[5, 6, 7], prompt], GREEDY)  # the good first prompt is aborted too
    with pytest.raises(exc, match=match):
        llm.add_request(prompt, GREEDY)
    assert not llm.engine.has_unfinished() and all_free(llm)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == want


def test_failed_step_finishes_its_requests_and_engine_recovers(llm, monkeypatch):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    model = llm.engine.runner.model
    real = model.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in the model")
        return real(*a, **k)

    monkeypatch.setattr(model, "forward", flaky)
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    reqs = [llm.engine.requests[i] for i in ids]
    with pytest.raises(RuntimeError, match="boom"):
        for _ in range(10):
            llm.step()
    assert [r.finish_reason for r in reqs] == ["error", "error"]
    check_ledger(llm)
    assert all_free(llm)
    calls["n"] = 1  # the next forward runs, the one after raises (inside generate)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts * 3, GREEDY)
    assert not llm.engine.has_unfinished() and all_free(llm)
    monkeypatch.setattr(model, "forward", real)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_preempted_request_longer_than_the_budget_is_readmitted():
    """Chunked prefill off, a pool that forces preemption, and requests that outgrow the
    budget: every request still finishes with its single-run tokens."""
    prompts = [[i + 1, 2 * i + 3, 7, 11, 13, 17] for i in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = make_llm()
    want = [ref.generate([p], params)[0].token_ids for p in prompts]
    llm = make_llm(
        max_num_batched_tokens=8, enable_chunked_prefill=False, num_blocks=11, max_model_len=24
    )
    out = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == want
    assert all(o.finish_reason == "length" for o in out)
    assert all_free(llm)


def test_two_threads_share_one_llm(llm):
    prompts = [[[i, i + 1, i + 2]] * 1 for i in range(1, 9)]
    want = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(idx: list[int]) -> None:
        try:
            for i in idx:
                got[i] = llm.generate(prompts[i], GREEDY)[0].token_ids
            for i in idx:  # streams too
                toks = [t for d in llm.generate_stream(prompts[i][0], GREEDY) for t in d.token_ids]
                assert toks == want[i]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=([0, 2, 4, 6],)),
               threading.Thread(target=work, args=([1, 3, 5, 7],))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [got[i] for i in range(8)] == want
    assert all_free(llm)


def test_leaving_a_stream_early_aborts_it(llm):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    stream = llm.generate_stream([3, 4, 5, 6, 7], params)
    next(stream)
    rid = max(llm.engine.requests)
    req = llm.engine.requests[rid]
    assert llm.engine.scheduler.manager.request_ids() == [rid]
    stream.close()
    assert req.finish_reason == "abort" and all_free(llm) and not llm.engine.requests
    for _ in llm.generate_stream([3, 4, 5], params):
        break  # the unreferenced generator is closed (CPython: at once), aborting its request
    assert all_free(llm)
    llm.abort(rid)  # already finished: no-op
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort(10**9)


def test_finished_requests_are_dropped(llm):
    """A long run of many requests (add_request, generate, streams, aborts): the engine's
    table holds exactly the live requests, the LLM keeps add_request's results only until
    pop_finished, and aborting a finished id is a no-op."""
    core = llm.engine
    llm.pop_finished()  # what earlier tests on this module's LLM left uncollected
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = llm.generate([[7, 8, 9]], params)[0].token_ids
    for k in range(40):
        ids = [llm.add_request([k % 50 + 1, j + 2, 3], params) for j in range(3)]
        llm.abort(ids[1])
        assert [o.token_ids for o in llm.generate([[7, 8, 9]], params)] == [want]
        assert len([d for d in llm.generate_stream([7, 8, 9], params)]) == 3
        while core.has_unfinished():
            live = {r.request_id for r in core.scheduler.waiting + core.scheduler.running}
            assert set(core.requests) == live
            llm.step()
        assert not core.requests
        outs = llm.pop_finished()
        assert [o.request_id for o in outs] == ids
        assert [o.finish_reason for o in outs] == ["length", "abort", "length"]
        assert not llm.pop_finished() and not llm._added
        llm.abort(ids[0])  # finished and collected: still a no-op
    assert core._next_id > 200 and not core.requests and all_free(llm)
    for bad in (core._next_id, -1, "0", 2.0, True):
        with pytest.raises(ValueError, match="unknown request id"):
            llm.abort(bad)


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(temperature=math.nan), ValueError),
        (dict(temperature=math.inf), ValueError),
        (dict(top_p=math.nan), ValueError),
        (dict(top_p=-math.inf), ValueError),
        (dict(max_tokens=True), TypeError),
        (dict(seed=-1), ValueError),
        (dict(seed=2**63), ValueError),
        (dict(temperature="hot"), TypeError),
        (dict(stop=5), TypeError),
        (dict(stop=[1]), TypeError),
        (dict(stop_token_ids=[1.5]), TypeError),
        (dict(stop_token_ids=5), TypeError),
        (dict(stop_token_ids=[True]), TypeError),
        (dict(stop_token_ids=[-1]), ValueError),
        (dict(ignore_eos="no"), TypeError),
        (dict(skip_special_tokens=1), TypeError),
    ],
)
def test_sampling_params_refused(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):  # the message names the field
        SamplingParams(**kw)


def test_prompt_forms(llm):
    """Token ids as a tensor or array are one prompt, a 2-d tensor one prompt per row; other
    shapes and types give a TypeError that says what a prompt must be."""
    import numpy as np
    import torch

    want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], GREEDY)]
    assert llm.generate(torch.tensor([5, 6, 7]), GREEDY)[0].token_ids == want[0]
    assert llm.generate(np.array([5, 6, 7]), GREEDY)[0].token_ids == want[0]
    assert llm.generate([np.int64(5), 6, 7], GREEDY)[0].token_ids == want[0]
    rows = llm.generate(torch.tensor([[5, 6, 7], [8, 9, 9]]), GREEDY)
    assert len(rows) == 2 and rows[0].token_ids == want[0]
    assert [o.token_ids for o in llm.generate([torch.tensor([5, 6, 7]), [8, 9]], GREEDY)] == want
    for bad, match in [
        (None, "prompts must be"),
        (torch.tensor(3), "prompts must be"),
        (b"ab", "prompts must be"),
        ([None], "a prompt must be"),
        ([2.0, 1], r"prompt_token_ids\[0\]"),
        ([np.float32(1)], r"prompt_token_ids\[0\]"),
    ]:
        with pytest.raises(TypeError, match=match):
            llm.generate(bad, GREEDY)
    assert not llm.engine.has_unfinished() and all_free(llm)


def test_loaders_name_the_file(tmp_path):
    trunc = tmp_path / "m.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(ValueError, match=r"m\.gguf: not a readable GGUF model"):
        LLM(str(trunc), device="cpu")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: a config must be a JSON object"):
        LLM(tmp_path / "cfg", device="cpu")


def test_engine_settings_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        make_llm(max_model_len=9000)


def test_model_path_accepted(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                      max_position_embeddings=128)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    a = LLM(pathlib.Path(tmp_path), device="cpu", backend="vanilla", max_model_len=32)
    b = LLM(str(tmp_path), device="cpu", backend="vanilla", max_model_len=32)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    assert a.generate([[1, 2, 3]], p)[0].token_ids == b.generate([[1, 2, 3]], p)[0].token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        a.generate([[64]], p)


def test_cli_error_is_one_line(capsys, monkeypatch):
    import torch

    from kvplan.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["generate", "hi", "--model", "random:tiny-llama", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("kvplan generate: ")
    assert "Traceback" not in err[0]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bench", "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (["bench", "--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
        (["bench", "--new-tokens", "-3"], "--new-tokens must be >= 1, got -3"),
        (["generate", "x", "--model", "{tmp}/m.gguf"], "m.gguf: not a readable GGUF model"),
        (["generate", "x", "--model", "{tmp}"], "No such file"),  # an OSError
    ],
)
def test_cli_bad_arguments_are_one_line(capsys, monkeypatch, tmp_path, argv, match):
    from kvplan.cli import main

    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00")
    if argv[-1] == "{tmp}":  # a folder whose config.json cannot be read: an OSError inside

        def unreadable(folder):
            raise FileNotFoundError(f"No such file: {folder}/config.json")

        monkeypatch.setattr("kvplan.models.loader.read_hf_config", unreadable)
    argv = [a.format(tmp=tmp_path) for a in argv] + ["--device", "cpu"]
    if argv[0] == "bench":
        argv += ["--config", "tiny-llama"]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and match in err[0] and "Traceback" not in err[0]


def fuzz(llm, ref, rng, *, vocab, params, ops, max_prompt, bad, check, keep_streams=0.0,
         prefixes=()):  # fmt: skip
    """``ops`` random add / step / abort / stream / bad-request operations on ``llm``, then
    steps until idle; ``check()`` after each one. Every request that ran to its length equals
    ``ref``'s single run of it (``ref`` None: none compared, for settings whose outputs may
    depend on the scheduling). With ``prefixes``, added prompts start with a random part of
    a random one of them (prefix reuse). Returns how many were compared."""
    live: dict[int, list[int]] = {}
    single: dict[tuple, list[int]] = {}
    streams = []
    checked = 0

    def compare_finished() -> int:
        n = 0
        for out in llm.pop_finished():
            prompt = live.pop(out.request_id)
            if out.finish_reason == "length" and ref is not None:
                key = tuple(prompt)
                if key not in single:
                    single[key] = ref.generate([prompt], params)[0].token_ids
                assert out.token_ids == single[key]
                n += 1
        return n

    for _ in range(ops):
        op = rng.choice(["add", "add", "step", "step", "step", "abort", "stream", "bad"])
        if op == "add":
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            if prefixes:
                prompt = rng.choice(prefixes)[: rng.randint(0, max_prompt)] + prompt
                prompt = prompt[: max_prompt + rng.randint(0, 8)]
            live[llm.add_request(prompt, params)] = prompt
        elif op == "step" and llm.engine.has_unfinished():
            llm.step()
        elif op == "abort" and live:
            llm.abort(rng.choice(sorted(live)))
        elif op == "stream":
            s = llm.generate_stream([rng.randrange(vocab) for _ in range(4)], params)
            for _ in range(rng.randint(1, 3)):
                if next(s, None) is None:
                    break
            streams.append(s)
            if rng.random() >= keep_streams:
                streams.pop().close()
        elif op == "bad":
            with pytest.raises((ValueError, TypeError)):
                llm.add_request(rng.choice(bad), params)
        check()
        checked += compare_finished()
        assert set(llm.engine.requests) >= set(live)  # the unfinished ones are live
    for s in streams:
        s.close()
    while llm.engine.has_unfinished():
        llm.step()
        check()
    return checked + compare_finished()


def test_fuzz_block_ledger():
    """Random add / step / abort / stream-close / bad requests on a small pool; the ledger
    holds after every operation and surviving greedy requests equal their single runs."""
    llm = make_llm(
        max_num_batched_tokens=16, enable_chunked_prefill=False, num_blocks=12, max_model_len=32
    )
    checked = fuzz(llm, make_llm(), random.Random(0), vocab=VOCAB, params=GREEDY, ops=150,
                   max_prompt=10, bad=[[VOCAB], [-3], [1.5], [1] * 17, [1] * 70],
                   check=lambda: check_ledger(llm), keep_streams=0.3)  # fmt: skip
    assert all_free(llm) and checked > 5


def check_hybrid_ledger(llm: LLM, shared: bool) -> None:
    """A DeepSeek-V4 engine's ledger: free + held blocks fill the pool (without ``shared``
    prefixes no block is in two requests), only running requests hold blocks, each its own
    state slot, the family tracks only them, snapshots stay within their capacity."""
    core, m = llm.engine, llm.parts.manager
    hybrid = core.runner.families["hybrid"]
    held = [b for rid in m.request_ids() for b in m.get_block_ids(rid) if b]
    if not shared:
        assert len(held) == len(set(held))  # no block in two requests
    assert m.num_free_blocks() + len(set(held)) == llm.parts.num_blocks - 1
    running = {r.request_id for r in core.scheduler.running}
    assert set(m.request_ids()) == running
    slots = [m.get_state_slot(rid) for rid in running]
    assert len(slots) == len(set(slots))
    assert set(hybrid.family._cached_len) <= running
    snaps = hybrid.snapshots
    assert snaps.num_registered + snaps.num_pending <= snaps.capacity


def test_deepseek_v4_token_ids_checked_against_its_vocab(tmp_path):
    from tests.models.dsv4_testlib import hf_config, hf_model

    cfg = hf_config(0)
    hf_model(cfg, 0).save_pretrained(tmp_path / "dsv4")
    llm = LLM(pathlib.Path(tmp_path / "dsv4"), max_model_len=48)
    vocab = llm.engine.runner.model.model.config.vocab_size
    assert llm.engine.vocab_size == vocab == cfg.vocab_size
    with pytest.raises(ValueError, match=f"={vocab} is outside"):
        llm.generate([[1, vocab]], GREEDY)
    assert not llm.engine.has_unfinished() and len(llm.generate([[1, 2]], GREEDY)[0].token_ids) == 6


@pytest.mark.parametrize("shared,spec", [(False, 0), (True, 0), (True, 4)])
def test_fuzz_deepseek_v4_ledger(tmp_path, shared, spec):
    """The hybrid family under random add / step / abort / stream-close / bad requests on a
    pool too small for every request at once (preemptions): after every operation each live
    request holds its own state slot, free + held blocks fill the pool, the family tracks
    only live requests, snapshots are registered or pending within their capacity;
    surviving greedy requests equal their single runs (no prefix cache); at the end every
    block and slot is free. ``shared``: prompts share prefixes, so requests share blocks and
    resume from state snapshots. ``spec``: n-gram drafts (verification rows rolled back)."""
    from tests.models.dsv4_testlib import hf_config, hf_model

    cfg = hf_config(4)
    folder = tmp_path / "dsv4"
    hf_model(cfg, 4).save_pretrained(folder)
    vocab = cfg.vocab_size
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM(str(folder), device="cpu", max_model_len=64, enable_prefix_caching=False)
    llm = LLM(str(folder), device="cpu", max_model_len=64, max_num_seqs=3,
              max_num_batched_tokens=24, num_blocks=6, num_speculative_tokens=spec)  # fmt: skip
    core, m = llm.engine, llm.parts.manager
    hybrid = core.runner.families["hybrid"]
    verified = []  # drafts accepted per verification row
    checked_drafts = hybrid.drafts_verified
    hybrid.drafts_verified = lambda step, acc: (verified.extend(acc.values()),
                                                checked_drafts(step, acc))  # fmt: skip
    family, snaps = hybrid.family, hybrid.snapshots
    num_blocks = llm.parts.num_blocks
    rng = random.Random(4)
    prefixes = [[rng.randrange(vocab) for _ in range(40)] for _ in range(3)] if shared else ()
    checked = fuzz(llm, ref, rng, vocab=vocab, params=params, ops=150, max_prompt=40,
                   bad=[[vocab], [-1], [2.0], [1] * 70],
                   check=lambda: check_hybrid_ledger(llm, shared),
                   prefixes=prefixes)  # fmt: skip
    assert not m.request_ids() and m.num_free_blocks() == num_blocks - 1
    assert not family._cached_len and not family._owner
    assert checked > 5 and core.scheduler.num_preemptions > 0
    assert snaps.num_pending == 0
    if shared:
        assert snaps.num_restored > 0
    if spec:
        assert len(verified) > 10 and 0 < sum(verified) < spec * len(verified)
