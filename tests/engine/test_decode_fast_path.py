"""Decode fast paths (Scheduler.DecodeBatch + extend_many, EngineCore._update_decode_rows +
commit_tokens_many) against the general per-request loops they replace.

The reference is the same code with the fast paths switched off: every step goes through
``Scheduler._schedule_general`` and ``EngineCore._update_rows``. Random workloads with fixed
seeds cover preemption (out of blocks inside the fast path), admission limits, finishes,
aborts, stop ids / EOS / stop strings / max_tokens and sampled requests.
"""

from __future__ import annotations

import random

import pytest
from engine_testlib import run_schedules

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.cache import KVCacheManager
from kvplan.engine.request import Request, RequestStatus
from kvplan.engine.scheduler import Scheduler
from kvplan.engine.step import StepBatch
from kvplan.models.config import named_config

CFG = named_config("tiny-llama")


def _general_only(scheduler: Scheduler) -> Scheduler:
    """Switch the scheduler's decode fast path off (no DecodeBatch either)."""
    general = scheduler._schedule_general
    scheduler.schedule = lambda: StepBatch.general(*general())
    return scheduler


def _manager_state(m: KVCacheManager):
    pool = m.pools[0]
    reqs = {
        rid: (m.num_tokens(rid), m.num_committed_tokens(rid), m.get_block_ids(rid))
        for rid in m.request_ids()
    }
    return pool.free_block_ids(), sorted(pool.cached_blocks().items()), reqs


def _rows(out):
    return [(s.request.request_id, s.num_query_tokens, s.is_prefill, s.drafts) for s in out.seqs]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_scheduler_fast_path_equals_general_loop(seed):
    """Two schedulers over two managers see the same events; every step's rows, preemptions,
    queues and block ids agree, and the fast path (including its out-of-blocks fallback)
    really runs."""
    rng = random.Random(seed)
    sides = []
    for fast in (True, False):
        mgr = KVCacheManager(18, 4, max_blocks_per_seq=16)
        s = Scheduler(mgr, max_num_batched_tokens=rng.choice([6, 40]), max_num_seqs=3)
        sides.append((s if fast else _general_only(s), {}))
    fast_sched = sides[0][0]
    calls = {"fast": 0, "out_of_blocks": 0}
    inner, extend_many = fast_sched._schedule_decode_batch, fast_sched.manager.extend_many

    def counting_schedule():
        out = inner()
        calls["fast"] += out is not None
        return out

    def counting_extend(ids, n):
        result = extend_many(ids, n)
        calls["out_of_blocks"] += not result.ok
        return result

    fast_sched._schedule_decode_batch = counting_schedule
    fast_sched.manager.extend_many = counting_extend
    next_id = 0
    for _ in range(120):
        if rng.random() < 0.15:  # a new request
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 14))]
            for s, reqs in sides:
                reqs[next_id] = Request(next_id, list(prompt), SamplingParams(max_tokens=40))
                s.add(reqs[next_id])
            next_id += 1
        outs = [s.schedule() for s, _ in sides]
        assert _rows(outs[0]) == _rows(outs[1])
        assert [r.request_id for r in outs[0].preempted] == [
            r.request_id for r in outs[1].preempted
        ]
        tokens = [rng.randrange(50) for _ in outs[0].seqs]
        finish = [s.request.request_id for s in outs[0].seqs if rng.random() < 0.04]
        for (s, reqs), out in zip(sides, outs):
            for row, t in zip(out.seqs, tokens):  # what the engine does after a step
                r = row.request
                samples = row.samples
                r.num_computed_tokens += row.num_query_tokens
                if samples:
                    r.output_token_ids.append(t)
                    if len(r.output_token_ids) == 30 and r.request_id not in finish:
                        finish.append(r.request_id)
            for rid in finish:
                s.finish(reqs[rid], "length")
            assert [r.request_id for r in s.running] == [r.request_id for r in sides[0][0].running]
            assert [r.request_id for r in s.waiting] == [r.request_id for r in sides[0][0].waiting]
        assert _manager_state(sides[0][0].manager) == _manager_state(sides[1][0].manager)
    assert calls["fast"] > 10 and calls["out_of_blocks"] > 0, calls
    assert fast_sched.num_preemptions > 0


def test_fast_path_out_of_blocks_preempts_like_the_general_loop():
    """Three decoding requests fill the pool; the next decode step needs a block for the
    first: the fast path rewinds and the general loop preempts the latest admitted."""
    mgr = KVCacheManager(7, 4, max_blocks_per_seq=8, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = [Request(i, list(range(7)), SamplingParams(max_tokens=50)) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = run_schedules(s, 2, 1)[-1]
    assert out.decode_batch is not None and [mgr.num_tokens(i) for i in range(3)] == [8] * 3
    out = s.schedule()  # 9 tokens each: request 0 needs a third block, none is free
    assert [r.request_id for r in out.preempted] == [2] and reqs[2].status is RequestStatus.WAITING
    assert [row.request.request_id for row in out.seqs] == [0, 1]
    assert out.decode_batch.request_ids == [0, 1]  # the rest still decode: a new batch
    assert [mgr.num_tokens(i) for i in range(2)] == [9, 9] and mgr.num_free_blocks() == 0


def _workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(CFG.vocab_size) for _ in range(8)]
    out = []
    for _ in range(24):
        prompt = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.4:
            prompt = shared + prompt
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.0, 0.8]),
            seed=rng.randrange(1000),
            stop_token_ids=[rng.randrange(CFG.vocab_size) for _ in range(rng.choice([0, 30]))],
            stop=rng.choice([None, "q", ("zz", "k")]),
            ignore_eos=rng.random() < 0.5,
        )
        out.append((prompt, params))
    return out


def _run_fast_and_general(seed: int, check_coverage: bool = True, **llm_kw) -> list:
    """Same requests, aborts and arrivals through two engines, one with the fast paths off;
    checks identical tokens, finish reasons, stop cuts, preemptions and prefix-cache state.
    ``check_coverage``: also require that the workload hit every finish reason and a
    preemption (true for the CPU tokens of the fixed seeds; other devices give other tokens,
    so which paths a seed reaches differs there). Returns the two engines."""
    work = _workload(seed)
    engines = []
    for fast in (True, False):
        llm = _LLM(CFG, block_size=4, max_model_len=48, max_num_seqs=6, num_blocks=16, **llm_kw)
        core = llm.engine
        core.eos_token_ids = frozenset(range(0, CFG.vocab_size, 7))
        core.decode_text = lambda ids: "".join(chr(97 + t % 26) for t in ids)
        if not fast:
            _general_only(core.scheduler)
            core.decode_fast_path = False
        engines.append(core)
    ids: list[list[int]] = [[], []]
    added: list[list] = [[], []]  # each engine's Request objects, in order
    fast_steps = 0
    for step in range(400):
        if step % 2 == 0 and work:
            prompt, params = work.pop(0)
            for core, got, reqs in zip(engines, ids, added):
                reqs.append(core.add_request(prompt, params))
                got.append(reqs[-1].request_id)
        if step in (9, 20):
            for core, got in zip(engines, ids):
                core.abort(got[len(got) // 2])
        fast_steps += engines[0].scheduler._decode is not None
        touched = [[r.request_id for r in core.step()] for core in engines]
        assert touched[0] == touched[1]
        if not work and not engines[0].has_unfinished():
            break
    assert not engines[1].has_unfinished() and fast_steps > 5
    results = [
        [(r.output_token_ids, r.finish_reason, r.stop_text_len) for r in reqs] for reqs in added
    ]
    assert results[0] == results[1]
    if check_coverage:
        reasons = {reason for _, reason, _ in results[0]}
        assert {"stop", "length", "abort"} <= reasons
        assert engines[0].scheduler.num_preemptions > 0
    managers = [core.scheduler.manager for core in engines]
    assert _manager_state(managers[0]) == _manager_state(managers[1])
    assert engines[0].scheduler.num_preemptions == engines[1].scheduler.num_preemptions
    assert managers[0].num_free_blocks() == 15
    return engines


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_fast_paths_equal_general_loop(seed):
    _run_fast_and_general(seed, device="cpu", backend="block_offsets")


@pytest.mark.gpu
def test_engine_fast_paths_equal_general_loop_with_cuda_graphs():
    fast, general = _run_fast_and_general(
        0, False, device="cuda", dtype="float32", async_scheduling=False
    )  # per-step outputs are compared: no lookahead (tests/engine/test_async_scheduling.py)
    assert fast.runner.graphs is not None and fast.runner.graphs.num_replays > 0
    assert general.runner.graphs.num_replays > 0


def test_decode_batch_lists_are_reused_while_the_batch_is_unchanged():
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [Request(i, [i + 1] * 3, SamplingParams(max_tokens=9)) for i in range(3)]
    for r in reqs:
        s.add(r)
    batches = [out.decode_batch for out in run_schedules(s, 4, 5)]
    assert batches[0] is None and batches[1] is not None
    assert batches[2] is batches[1] and batches[3] is batches[1]
    assert batches[1].request_ids == [0, 1, 2] and batches[1].all_greedy
    s.finish(reqs[1], "abort")  # it leaves the batch; the others keep the fast path
    assert batches[1].request_ids == [0, 1, 2]  # the batch given out is never changed
    remembered = s._decode
    out = s.schedule()
    assert out.decode_batch is remembered and out.decode_batch.request_ids == [0, 2]
    assert [mgr.num_tokens(i) for i in (0, 2)] == [7, 7]  # 3 prompt + 4 decode steps
