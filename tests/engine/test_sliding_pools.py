"""Sliding-window models on O(window) pools in the engine (CPU, fp32, a random tiny Gemma 3:
two sliding layers of window 12 and one full layer, 4-token blocks).

* a memory budget that holds 2 full-length sequences with full pages in every layer holds 4
  with window pools, and the engine really runs 4 at once, with Hugging Face's tokens;
* the decode fast path and async scheduling run for the sliding model and equal the per-row
  path (tokens, finish reasons, and with the fast path alone every block id and free list);
* a fuzz of adds, steps and aborts keeps the block ledger of every pool exact.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
from hf_models import hf_greedy, make_gemma3_model, random_prompts

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.cache.block_pool import hash_prompt_blocks
from kvplan.cache.pool_sizing import plan_pool_blocks
from kvplan.engine import builder
from kvplan.engine.step import StepBatch
from kvplan.models.config import ModelConfig

LLM = partial(_LLM, device="cpu")
WINDOW, BLOCK, MAX_LEN, BUDGET = 12, 4, 128, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, HF model, model config)."""
    hf = make_gemma3_model(seed=1, window=WINDOW)
    folder = tmp_path_factory.mktemp("gemma3_pools")
    hf.save_pretrained(str(folder))
    return folder, hf, ModelConfig.from_hf(hf.config)


def _engine(folder, **kw):
    args = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET)
    return LLM(str(folder), **{**args, **kw})


def _layer_bytes(cfg) -> int:
    return builder.layer_block_bytes(cfg, BLOCK, "fp32")


def _check_ledger(llm) -> None:
    """Per pool: each block's reference count equals the table entries naming it among the
    live requests, and a block is free exactly when nothing names it."""
    m = llm.engine.scheduler.manager
    assert set(m.request_ids()) == {r.request_id for r in llm.engine.scheduler.running}
    for p, pool in enumerate(m.pools):
        refs = [0] * pool.num_blocks
        for rid in m.request_ids():
            for b in m.get_block_ids(rid, p):
                refs[b] += b != 0
        for b in range(1, pool.num_blocks):
            assert pool.ref_count(b) == refs[b], (p, b)
            assert pool.is_free(b) == (refs[b] == 0), (p, b)
        assert pool.num_free_blocks == sum(r == 0 for r in refs[1:])


def _all_free(llm) -> bool:
    m = llm.engine.scheduler.manager
    sizes = llm.parts.pool_sizes.num_blocks
    return not m.request_ids() and all(
        m.num_free_blocks(p) == sizes[p] - 1 for p in range(m.num_pools)
    )


def test_engine_pool_sizes_follow_the_documented_split(tiny):
    folder, _, cfg = tiny
    lb = _layer_bytes(cfg)
    llm = _engine(folder, kv_cache_memory=200 * lb, max_num_seqs=8)
    sizes = llm.parts.pool_sizes
    m = llm.parts.manager
    assert m.window_sizes == (WINDOW, None) and sizes.window_sizes == (WINDOW, None)
    # window pool: cdiv(12 + 8 + 4 - 2, 4) = 6 blocks a sequence, for the 4 max_model_len
    # sequences that fit in every pool: (4 * 6 + 1) * 2 layers; the full pool takes the rest
    assert sizes.blocks_per_seq == (6, 32) and sizes.num_window_seqs == 4
    assert sizes.num_blocks == (25, 200 - 50)
    assert [p.num_blocks for p in m.pools] == [25, 150]
    kv = llm.parts.kv_cache
    assert [kv.k_cache(layer).shape[0] for layer in range(3)] == [25, 25, 150]
    assert sizes.total_bytes == 200 * lb
    with pytest.raises(ValueError, match="kv_cache_memory=.* cannot hold one sequence"):
        _engine(folder, kv_cache_memory=40 * lb)
    with pytest.raises(ValueError, match="sliding_window_kv must be one of .* got 'ring'"):
        _engine(folder, kv_cache_memory=200 * lb, sliding_window_kv="ring")


def _most_long_at_once(llm, prompts, params, long: int):
    """Run every prompt; (tokens per prompt, most running requests holding >= ``long`` tokens
    at once), checking the ledger after every step."""
    sched, m = llm.engine.scheduler, llm.parts.manager
    ids = [llm.add_request(p, params) for p in prompts]
    outs, most = {}, 0
    while sched.has_unfinished():
        for req in llm.step():
            if req.finished:
                outs[req.request_id] = req.output_token_ids
        most = max(most, sum(m.num_tokens(r.request_id) >= long for r in sched.running))
        _check_ledger(llm)
    return [outs[i] for i in ids], most


def test_window_pools_admit_more_sequences_in_the_same_memory(tiny):
    """200 layer-blocks of memory: full pages in every layer (96 layer-blocks per 128-token
    sequence, 65 usable blocks per pool) hold 2 sequences of 100+ tokens, window pools
    (25 window blocks for 2 layers, 150 full blocks) hold 4. Six 8-token prompts growing to 128
    tokens: the engine keeps 4 of them past 100 tokens at once instead of 2, with HF's
    tokens (preemption by recompute sorts out the rest)."""
    folder, hf, cfg = tiny
    lb = _layer_bytes(cfg)
    memory = 200 * lb
    paged = plan_pool_blocks(
        (WINDOW, None), (2 * lb, lb), block_size=BLOCK, max_blocks_per_seq=32, max_num_seqs=6,
        max_num_batched_tokens=BUDGET, windowed=False, memory=memory,
    )  # fmt: skip
    assert paged.num_blocks == (66, 66)  # (66 - 1) // 25 == 2 sequences of 100 tokens
    prompts = random_prompts(6, 8, 8, hf.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    expected = hf_greedy(hf, prompts, 120)

    llm = _engine(folder, kv_cache_memory=memory, max_num_seqs=6)
    assert llm.parts.pool_sizes.num_blocks == (25, 150)
    tokens, most = _most_long_at_once(llm, prompts, params, 100)
    assert tokens == expected
    assert most >= 4
    assert _all_free(llm)

    # the same engine with full pages in every layer (no out-of-window release)
    full = _engine(folder, kv_cache_memory=memory, max_num_seqs=6, sliding_window_kv="full")
    assert not full.parts.manager.release_out_of_window
    assert full.parts.pool_sizes.num_blocks == paged.num_blocks
    tokens, most_full = _most_long_at_once(full, prompts, params, 100)
    assert tokens == expected and most_full == 2 < most
    assert _all_free(full)


def _general_only(core) -> None:
    """The per-request loops only: no remembered decode batch, no batched update."""
    general = core.scheduler._schedule_general
    core.scheduler.schedule = lambda: StepBatch.general(*general())
    core.decode_fast_path = False


def _manager_state(m):
    pools = [(pool.free_block_ids(), sorted(pool.cached_blocks().items())) for pool in m.pools]
    reqs = {
        rid: [m.get_block_ids(rid, p) for p in range(m.num_pools)] + [m.num_committed_tokens(rid)]
        for rid in m.request_ids()
    }
    return pools, reqs


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_path_and_async_scheduling_run_for_a_sliding_model(tiny, seed):
    """Three engines see the same arrivals and aborts: per-row loops, the decode fast path,
    the fast path with async scheduling. Tokens and finish reasons agree; the fast path's
    manager state (free lists, cached hashes, block tables) equals the per-row one after
    every step; the fast path and the lookahead really run."""
    folder, _, _ = tiny
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(20)]  # longer than the window
    work = []
    for _ in range(14):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.4:
            prompt = shared + prompt
        stop = [rng.randrange(256) for _ in range(rng.choice([0, 0, 20]))]
        work.append((prompt, SamplingParams(max_tokens=rng.randint(1, 40), stop_token_ids=stop,
                                            ignore_eos=True)))  # fmt: skip
    engines = []
    for mode in ("general", "fast", "async"):
        llm = _engine(folder, num_blocks=100, max_num_seqs=6, async_scheduling=mode == "async")
        if mode == "general":
            _general_only(llm.engine)
        engines.append(llm.engine)
    added: list[list] = [[], [], []]
    for step in range(800):
        for _ in range(rng.choice([1, 2, 3]) if work and rng.random() < 0.1 else 0):
            if work:  # arrivals in bursts: batches stay unchanged for a while
                prompt, params = work.pop(0)
                for core, reqs in zip(engines, added):
                    reqs.append(core.add_request(prompt, params))
        live = [i for i, r in enumerate(added[0]) if not r.finished]
        if step % 25 == 12 and live:  # the same request in every engine (abort drains first)
            victim = live[len(live) // 2]
            for core, reqs in zip(engines, added):
                core.abort(reqs[victim].request_id)
        for core in engines:
            core.step()
        m_general, m_fast = (core.scheduler.manager for core in engines[:2])
        assert _manager_state(m_fast) == _manager_state(m_general)
        if not work and not any(core.has_unfinished() for core in engines):
            break
    results = [[(r.output_token_ids, r.finish_reason) for r in reqs] for reqs in added]
    assert results[0] == results[1] == results[2]
    assert {"stop", "length", "abort"} <= {reason for _, reason in results[0]}
    general, fast, lookahead = engines
    assert general.num_fast_decode_steps == 0
    assert fast.num_fast_decode_steps > 20 and fast.num_steps_ahead == 0
    assert lookahead.num_steps_ahead > 20 and lookahead.num_fast_decode_steps > 20
    for core in engines:
        m = core.scheduler.manager
        assert m.release_out_of_window and not m.request_ids()
        assert [m.num_free_blocks(p) for p in range(m.num_pools)] == [
            pool.num_blocks - 1 for pool in m.pools
        ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fuzz_block_ledger_with_windows(tiny, async_scheduling):
    """Random adds, steps and aborts on small pools (preemption, prefix hits past the window,
    chunked prefill): after every operation each pool's reference counts equal the live
    tables; surviving requests equal their single runs; everything is free at the end."""
    folder, _, _ = tiny
    rng = random.Random(3)
    llm = _engine(folder, num_blocks=34, max_num_seqs=4, async_scheduling=async_scheduling)
    ref = _engine(folder, num_blocks=40, max_num_seqs=1)
    shared = [rng.randrange(256) for _ in range(17)]
    live: dict[int, tuple] = {}
    checked = 0
    for _ in range(260):
        op = rng.choice(["add", "add", "step", "step", "step", "step", "abort"])
        if op == "add":
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 24))]
            prompt = shared + prompt if rng.random() < 0.5 else prompt
            params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True)
            live[llm.add_request(prompt, params)] = (prompt, params)
        elif op == "step" and llm.engine.has_unfinished():
            llm.step()
        elif op == "abort" and live:
            llm.abort(rng.choice(sorted(live)))
        _check_ledger(llm)
        for out in llm.pop_finished():
            prompt, params = live.pop(out.request_id)
            if out.finish_reason == "length" and checked < 6:
                assert out.token_ids == ref.generate([prompt], params)[0].token_ids
                checked += 1
    while llm.engine.has_unfinished():
        llm.step()
        _check_ledger(llm)
    assert _all_free(llm) and checked == 6
    assert llm.engine.scheduler.num_preemptions > 0
    assert (llm.engine.num_steps_ahead > 0) == async_scheduling


def test_prefix_reuse_with_a_tight_window_pool(tiny):
    """A window pool sized for one sequence (6 usable blocks) evicts the shared prefix's early,
    released blocks while the first request prefills; later requests still reuse the 28-token
    prefix (the window pool needs only the blocks their first query sees: columns 4..6) and
    produce HF's tokens."""
    folder, hf, _ = tiny
    shared = random_prompts(1, 29, 29, 256, seed=3)[0]
    first = shared + [7]
    rest = [shared + t for t in random_prompts(2, 1, 9, 256, seed=4)]
    expected = hf_greedy(hf, [first], 1) + hf_greedy(hf, rest, 6)
    llm = _engine(folder, window_pool_seqs=1, max_num_seqs=2)
    assert llm.parts.pool_sizes.num_blocks[0] == 6 + 1  # one sequence's window blocks
    outs = [llm.generate([first], SamplingParams(max_tokens=1, ignore_eos=True))[0]]
    window_pool = llm.parts.manager.pools[0]
    assert window_pool.lookup(hash_prompt_blocks(first, BLOCK, 1)[0]) is None  # evicted
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs += [llm.generate([p], params)[0] for p in rest]
    assert [o.token_ids for o in outs] == expected
    assert [o.num_cached_prefix_tokens for o in outs] == [0, 28, 28]
    assert _all_free(llm)
