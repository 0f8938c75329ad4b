"""Prefix caching for DeepSeek-V4 (the hybrid family): shared blocks of compressed entries and
indexer keys, plus state snapshots at block boundaries (`kvplan.backends.hybrid.snapshots`).
Every output that resumed from a cached prefix equals HF's full ``generate`` of its prompt."""

from __future__ import annotations

import pytest
import torch

from kvplan import LLM, SamplingParams
from tests.models.dsv4_testlib import hf_greedy, random_tokens, saved_folder

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[0, 5])
def pair(request, tmp_path_factory):
    seed = request.param
    return saved_folder(seed, tmp_path_factory.mktemp(f"dsv4_{seed}"))


def make(folder: str, **kw) -> LLM:
    settings = dict(device="cpu", max_num_batched_tokens=64, max_num_seqs=3, max_model_len=128)
    settings.update(kw)
    return LLM(folder, **settings)


def snapshots(llm: LLM):
    return llm.engine.runner.families["hybrid"].snapshots


def test_repeated_prompt_resumes_at_its_last_block_boundary(pair):
    hf, folder = pair
    llm = make(folder)
    bs = llm.parts.manager.block_size
    assert bs == 16 and llm.engine.scheduler.resume_block_size == bs
    for n in (41, 48):
        p = random_tokens(n, n)
        want = hf_greedy(hf, p, GREEDY.max_tokens)
        first, again = llm.generate([p], GREEDY)[0], llm.generate([p], GREEDY)[0]
        assert first.num_cached_prefix_tokens == 0
        assert again.num_cached_prefix_tokens == (n - 1) // bs * bs  # 32 for both
        assert first.token_ids == want and again.token_ids == want
    assert snapshots(llm).num_restored == 2


def test_conversation_resumes_at_the_last_decode_boundary(pair):
    """The next turn's prompt holds the last turn's prompt and output: it resumes where the
    last turn's decode steps crossed their last block boundary."""
    hf, folder = pair
    llm = make(folder)
    p = random_tokens(1, 41)
    out = llm.generate([p], GREEDY)[0]
    p2 = p + out.token_ids + random_tokens(2, 7)
    o2 = llm.generate([p2], GREEDY)[0]
    # 41 + 19 tokens computed (the last sampled one is not): boundaries 16, 32, 48
    assert o2.num_cached_prefix_tokens == 48
    assert o2.token_ids == hf_greedy(hf, p2, GREEDY.max_tokens)
    p3 = p2 + o2.token_ids + random_tokens(3, 3)
    o3 = llm.generate([p3], GREEDY)[0]
    assert o3.num_cached_prefix_tokens == 80  # 68 + 19 computed: the newest boundary
    assert o3.token_ids == hf_greedy(hf, p3, GREEDY.max_tokens)


@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_shared_prefix_in_one_batch_with_chunked_prefill(pair, kv_format):
    """A system prompt sent once (one token out) leaves a snapshot at its last boundary;
    three questions after it, admitted together in small chunks, resume there."""
    hf, folder = pair
    system = random_tokens(7, 35)
    prompts = [system + random_tokens(10 + i, n) for i, n in enumerate((5, 12, 20))]
    llm = make(folder, max_num_batched_tokens=12, kv_format=kv_format)
    llm.generate([system], SamplingParams(max_tokens=1, ignore_eos=True))
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_prefix_tokens for o in outs] == [32, 32, 32]
    if kv_format == "auto":
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    else:  # rounding: the same engine without the cache is the reference
        off = make(folder, max_num_batched_tokens=12, kv_format=kv_format,
                   enable_prefix_caching=False)  # fmt: skip
        ref = off.generate(prompts, GREEDY)
        assert [o.num_cached_prefix_tokens for o in ref] == [0, 0, 0]
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_a_shared_system_prompt_is_resumed_from_the_third_request_on(pair):
    """Questions after one system prompt, never sent alone: the second request finds the
    first one's blocks of the shared part cached but no state at their end, recomputes them
    and ends a chunk there (``num_shared_tokens``); from then on requests resume there."""
    hf, folder = pair
    system = random_tokens(8, 37)  # two full blocks (32 tokens) shared
    # each prompt's own last boundary (48 or 64) lies past the shared part
    qs = [system + random_tokens(20 + i, n) for i, n in enumerate((19, 24, 14, 21, 16))]
    llm = make(folder, max_num_batched_tokens=64)
    outs = [llm.generate([q], GREEDY)[0] for q in qs[:2]]
    outs += llm.generate(qs[2:4], GREEDY)  # two together: both resume
    outs.append(llm.generate([qs[4]], GREEDY)[0])
    assert [o.num_cached_prefix_tokens for o in outs] == [0, 0, 32, 32, 32]
    for q, o in zip(qs, outs):
        assert o.token_ids == hf_greedy(hf, q, GREEDY.max_tokens)


@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_questions_sent_together_wait_for_the_first_ones_system_prompt(pair, kv_format):
    """Questions after a system prompt, all sent at once, nothing cached: the first one's
    prefill computes the shared blocks and ends a chunk where they end (its state is kept
    there); the others wait a step for them (``wait_for_shared_prefix``) and resume there.
    Without waiting the questions compute the system prompt again."""
    hf, folder = pair
    system = random_tokens(40, 37)  # two full blocks (32 tokens) shared
    qs = [system + random_tokens(41 + i, n) for i, n in enumerate((19, 24, 14))]
    outs = {}
    for wait in (False, True):
        llm = make(folder, kv_format=kv_format, wait_for_shared_prefix=wait)
        outs[wait] = llm.generate(qs, GREEDY)
        waits = llm.engine.scheduler.num_prefix_waits
        assert (waits > 0) == wait
    # without waiting: only what an earlier chunk happened to leave (16 here: the second
    # question's first chunk, cut by the step's budget at a boundary)
    assert sum(o.num_cached_prefix_tokens for o in outs[False]) < 32
    assert [o.num_cached_prefix_tokens for o in outs[True]] == [0, 32, 32]
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    if kv_format == "auto":
        for q, o in zip(qs, outs[True]):
            assert o.token_ids == hf_greedy(hf, q, GREEDY.max_tokens)


def test_preemption_resumes_from_cached_prefixes_and_frees_everything(pair):
    hf, folder = pair
    prompts = [random_tokens(20 + i, 30) for i in range(4)]
    llm = make(folder, max_num_seqs=4, max_model_len=48, block_size=16, num_blocks=8,
               max_num_batched_tokens=2048)  # fmt: skip
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.parts.manager.prefix_cache_stats().num_hit_tokens > 0  # preempted ones resumed
    assert snapshots(llm).num_pending == 0
    assert llm.parts.manager.num_free_blocks() == 7


def test_evicted_snapshots_only_shorten_hits(pair):
    """One snapshot slot: each new snapshot evicts the last one; a prompt whose snapshot is
    gone is computed whole, and outputs stay exact."""
    hf, folder = pair
    llm = make(folder, max_num_seqs=1, prefix_state_snapshots=1)
    a, b = random_tokens(30, 40), random_tokens(31, 40)
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)  # 44 < 48
    got = [llm.generate([p], short)[0] for p in (a, b, a, a)]
    assert [o.num_cached_prefix_tokens for o in got] == [0, 0, 0, 32]
    for p, o in zip((a, b, a, a), got):
        assert o.token_ids == hf_greedy(hf, p, short.max_tokens)
    # a's decode steps cross 48: that snapshot replaces its prompt's (one slot)
    assert llm.generate([a], GREEDY)[0].num_cached_prefix_tokens == 32
    assert llm.generate([a], GREEDY)[0].num_cached_prefix_tokens == 0
    snaps = snapshots(llm)
    # evictions: b's 32 took a's, a's 32 took b's, a's 48 took a's 32, the last run's
    # 32 took the 48 and its 48 the 32
    assert snaps.capacity == 1 and snaps.num_evicted == 5


def test_prefix_caching_off_and_reset(pair):
    _, folder = pair
    off = make(folder, enable_prefix_caching=False)
    assert snapshots(off) is None and off.engine.scheduler.resume_block_size == 0
    assert snapshots(make(folder)).capacity == 12  # 4 x max_num_seqs
    with pytest.raises(ValueError, match="prefix_state_snapshots must be"):
        make(folder, prefix_state_snapshots=0)
    p = random_tokens(3, 41)
    assert [off.generate([p], GREEDY)[0].num_cached_prefix_tokens for _ in range(2)] == [0, 0]
    on = make(folder)
    on.generate([p], GREEDY)
    assert snapshots(on).num_registered > 0
    on.parts.manager.reset_prefix_cache()  # (also what a failed device step does)
    assert snapshots(on).num_registered == 0
    assert on.generate([p], GREEDY)[0].num_cached_prefix_tokens == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_prefix_caching_on_gpu_with_graphs_and_async_steps(pair, kv_format):
    """On CUDA (decode steps replay graphs, scheduled one step ahead): snapshots taken in
    replayed and eager steps resume repeats, conversations and a shared prefix with the
    tokens of the same engine without the cache (fp32)."""
    _, folder = pair
    kw = dict(device="cuda", dtype="float32", kv_format=kv_format, max_num_seqs=4,
              max_model_len=160, max_num_batched_tokens=24)  # fmt: skip
    on, off = LLM(folder, **kw), LLM(folder, **kw, enable_prefix_caching=False)
    graphs = on.engine.runner.graphs
    assert graphs is not None and on.engine.async_scheduling
    system = random_tokens(50, 35)
    batch = [system + random_tokens(51 + i, 9) for i in range(3)]
    p = random_tokens(60, 41)
    got, want = [], []
    for llm, out in ((on, got), (off, want)):
        llm.generate([system], SamplingParams(max_tokens=1, ignore_eos=True))
        out.extend(llm.generate(batch, GREEDY))
        first = llm.generate([p], GREEDY)[0]
        out.append(first)
        out.append(llm.generate([p + first.token_ids + random_tokens(61, 5)], GREEDY)[0])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_prefix_tokens for o in got] == [32, 32, 32, 0, 48]
    assert graphs.num_replays > 0 and snapshots(on).num_restored == 4


def _registered(llm: LLM, block_hash) -> list[torch.Tensor]:
    """Every state tensor of the snapshot registered under ``block_hash``."""
    snaps = snapshots(llm)
    slot = snaps.lookup(block_hash)
    assert slot is not None
    return [copy[slot].clone() for _, copy in snaps._pairs]


@pytest.mark.parametrize("kv_format,fused", [("auto", False), ("fp8", False), ("fp4", False),
                                              ("auto", True)])  # fmt: skip
def test_state_kept_inside_a_chunk_equals_a_cut_chunks_snapshot(pair, kv_format, fused,
                                                                monkeypatch):  # fmt: skip
    """A prompt whose chunk passes its last block boundary keeps its state there inside the
    chunk (`KeepPoints`): one prefill step instead of two, and the snapshot registered at the
    boundary holds bit for bit what the cut chunk's snapshot holds (rings and the CSA
    compressor rows of every layer); a repeat resumes there and equals HF. ``fused``: the
    compressor's fused kernel (CUDA's path; the interpreter here), whose raw gate the kept rows
    bias themselves.

    With the exact (fp32) cache the snapshots agree to fp32 rounding, not bit for bit: the
    two prompt steps hold 32 and 45 rows, and torch's CPU elementwise kernels compute a
    tensor's last elements past a whole number of vector pairs with scalar code (AVX-512:
    32 floats; an exp / silu there rounds otherwise), and a one-row GEMM is a GEMV, so a
    row's bits can depend on the step's row count (seen on an AVX-512 CPU; AVX2's 16-float
    pairs divide every tensor here). A wrong row or position differs by far more."""
    if fused:
        monkeypatch.setenv("KVPLAN_FUSED_COMPRESS", "1")
    hf, folder = pair
    prompt = random_tokens(30, 45)  # boundaries 16 and 32 inside one 45-token chunk
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    got = {}
    for keep in (False, True):
        llm = make(folder, kv_format=kv_format, max_num_batched_tokens=64)
        llm.engine.scheduler.keep_state_in_chunk = keep
        before = llm.engine.num_steps
        assert llm.generate([prompt], one)[0].num_cached_prefix_tokens == 0
        steps = llm.engine.num_steps - before
        got[keep] = (steps, llm)
    (cut_steps, cut), (kept_steps, kept) = got[False], got[True]
    assert (cut_steps, kept_steps) == (2, 1)
    assert snapshots(kept).num_taken == snapshots(cut).num_taken == 1
    [h] = list(snapshots(kept)._by_hash)
    assert list(snapshots(cut)._by_hash) == [h]
    for a, b in zip(_registered(cut, h), _registered(kept, h)):
        if kv_format != "auto":  # fp8 / fp4 records and every fp32 ring: bit for bit
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:  # fp32 (exact records' bytes too): CPU vector rounding, see the docstring
            torch.testing.assert_close(a.view(torch.float32), b.view(torch.float32),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    again = kept.generate([prompt], GREEDY)[0]
    assert again.num_cached_prefix_tokens == 32
    if kv_format == "auto":
        assert again.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_a_kept_point_without_a_free_snapshot_slot_is_skipped(pair):
    """Two prompts in one step, one snapshot slot: the first prompt's point inside its chunk
    takes it (pending until its block is hashed), the second's finds every slot pending and is
    skipped; both outputs equal HF, and only the first prompt resumes when repeated."""
    hf, folder = pair
    llm = make(folder, max_num_seqs=2, prefix_state_snapshots=1, max_num_batched_tokens=128)
    a, b = random_tokens(40, 40), random_tokens(41, 38)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)  # 42 < 48
    outs = llm.generate([a, b], short)
    assert [o.num_cached_prefix_tokens for o in outs] == [0, 0]
    for p, o in zip((a, b), outs):
        assert o.token_ids == hf_greedy(hf, p, short.max_tokens)
    assert snapshots(llm).num_taken == 1 and snapshots(llm).num_registered == 1
    again = [llm.generate([p], short)[0] for p in (a, b)]
    assert [o.num_cached_prefix_tokens for o in again] == [32, 0]
    for p, o in zip((a, b), again):
        assert o.token_ids == hf_greedy(hf, p, short.max_tokens)
