"""Async scheduling (EngineCore launches greedy decode step k + 1 before reading step k's
tokens) against the same engine with it off.

Two engines see the same requests, arrivals and aborts at the same ``step()`` calls; every
request's tokens, finish reason and stop cut must be equal, and the KV managers must end in
the same state (same free list and cached hashes; block ids of never-hashed blocks may
differ, see ``kvplan/engine/core.py``) with no leaked block. On CPU the "device" tokens are
CPU tensors, so the lookahead logic runs here too; the `gpu` variant adds CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
from engine_testlib import run_schedules

from kvplan import LLM, SamplingParams
from kvplan.cache import KVCacheManager
from kvplan.engine.request import Request
from kvplan.engine.scheduler import Scheduler
from kvplan.models.config import named_config

CFG = named_config("tiny-llama")


def _workload(seed: int, num: int, sampled: float):
    rng = random.Random(seed)
    shared = [rng.randrange(CFG.vocab_size) for _ in range(8)]
    out = []
    for _ in range(num):
        prompt = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.4:
            prompt = shared + prompt
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=0.8 if rng.random() < sampled else 0.0,
            seed=rng.randrange(1000),
            stop_token_ids=[rng.randrange(CFG.vocab_size) for _ in range(rng.choice([0, 0, 20]))],
            stop=rng.choice([None, None, "q", ("zz", "k")]),
            ignore_eos=rng.random() < 0.5,
        )
        out.append((prompt, params))
    return out


def _cache_state(m: KVCacheManager):
    """Per pool: the free block count and the set of cached hashes; plus the live requests.

    A lookahead step allocates before the pending step's finishes free their blocks, so it
    may take (evict) the least recently freed cached block where the synchronous order would
    have taken a just-freed unhashed one: which hashes stay cached may then differ, the free
    counts never.
    """
    pools = [(pool.num_free_blocks, set(pool.cached_blocks())) for pool in m.pools]
    return pools, sorted(m.request_ids(), key=repr)


def _run_on_off(seed: int, *, num_blocks: int, num_requests: int = 24, sampled: float = 0.1,
                abort_rate: float = 0.03, max_num_seqs: int = 6, **llm_kw) -> tuple:  # fmt: skip
    """Run one random workload through async on and off; assert equal results and state.
    Returns the two engines (on, off) and the async engine's requests."""
    rng = random.Random(1000 + seed)
    work = _workload(seed, num_requests, sampled)
    engines = []
    for on in (True, False):
        llm = LLM(CFG, block_size=4, max_model_len=64, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                  async_scheduling=on, **llm_kw)  # fmt: skip
        core = llm.engine
        assert core.async_scheduling is on
        core.eos_token_ids = frozenset(range(0, CFG.vocab_size, 24))
        core.decode_text = lambda ids: "".join(chr(97 + t % 26) for t in ids)
        engines.append(core)
    ids: list[list[int]] = [[], []]
    added: list[list] = [[], []]  # each engine's Request objects, in order
    for _ in range(600):
        for _ in range(rng.choice([1, 2, 4]) if work and rng.random() < 0.12 else 0):
            if work:  # arrivals in bursts, so that batches stay unchanged for a while
                prompt, params = work.pop(0)
                for core, got, reqs in zip(engines, ids, added):
                    reqs.append(core.add_request(prompt, params))
                    got.append(reqs[-1].request_id)
        if ids[0] and rng.random() < abort_rate:
            victim = rng.randrange(len(ids[0]))
            for core, got in zip(engines, ids):
                core.abort(got[victim])
        for core in engines:
            core.step()
        if not work and not any(core.has_unfinished() for core in engines):
            break
    assert not work and not any(core.has_unfinished() for core in engines)
    results = [
        [(r.output_token_ids, r.finish_reason, r.stop_text_len) for r in reqs] for reqs in added
    ]
    assert results[0] == results[1]
    assert all(r.finished for r in added[0]) and not engines[0].requests
    managers = [core.scheduler.manager for core in engines]
    (on_pools, on_reqs), (off_pools, off_reqs) = (_cache_state(m) for m in managers)
    assert on_reqs == off_reqs
    assert [free for free, _ in on_pools] == [free for free, _ in off_pools]
    for m in managers:
        assert m.num_free_blocks() == num_blocks - 1  # nothing leaked
    assert [e.scheduler.num_preemptions for e in engines][0] == engines[1].scheduler.num_preemptions
    assert engines[1].num_steps_ahead == 0
    return engines[0], engines[1], added[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_async_equals_sync_roomy_pool(seed):
    """Room for every request: many decode steps are launched ahead, and rows that finish by
    EOS / stop ids / stop strings while launched ahead are discarded."""
    on, _, on_reqs = _run_on_off(seed, num_blocks=200, max_num_seqs=16)
    assert on.num_steps_ahead > 20 and on.num_discarded_rows > 0
    reasons = {r.finish_reason for r in on_reqs}
    assert {"stop", "length", "abort"} <= reasons


@pytest.mark.parametrize("seed", [2, 3])
def test_async_equals_sync_small_pool_preempts(seed):
    """A pool of 24 blocks: preemption by recompute and drains because blocks may run out."""
    on, _, _ = _run_on_off(seed, num_blocks=24, sampled=0.0, enable_prefix_caching=False)
    assert on.scheduler.num_preemptions > 0
    assert on.num_steps_ahead > 5 and on.num_discarded_rows > 0


def test_async_equals_sync_prefix_cache_pool_pressure():
    """Prefix caching in a pool that cached blocks crowd: lookahead refused, then taken."""
    on, _, _ = _run_on_off(0, num_blocks=30, sampled=0.0)
    assert on.num_steps_ahead > 5 and on.scheduler.num_preemptions > 0


def test_generate_and_stream_are_unchanged():
    prompts = [[3, 4, 5], [7] * 9, [11, 12]]
    params = [SamplingParams(max_tokens=n) for n in (9, 5, 12)]
    outs = []
    streams = []
    for on in (True, False):
        llm = LLM(CFG, block_size=4, max_model_len=48, num_blocks=40, async_scheduling=on)
        outs.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        llm.add_request([9, 9, 9], SamplingParams(max_tokens=20))  # shares the steps
        streams.append([d.token_ids for d in llm.generate_stream([5, 6], params[2])])
        while llm.engine.has_unfinished():
            llm.step()
        assert llm.engine.scheduler.manager.num_free_blocks() == 39
        if on:
            assert llm.engine.num_steps_ahead > 0
    assert outs[0] == outs[1]
    assert [t for d in streams[0] for t in d] == [t for d in streams[1] for t in d]
    default = LLM(CFG, max_model_len=48, num_blocks=40).engine  # CPU: off by default
    assert default.async_scheduling is False


def test_schedule_ahead_refuses_what_could_change():
    mgr = KVCacheManager(12, 4, max_blocks_per_seq=8, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [Request(i, [1, 2, 3], SamplingParams(max_tokens=20)) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = run_schedules(s, 2, 5)[-1]
    batch = out.decode_batch
    assert batch is not None and [mgr.num_tokens(i) for i in range(3)] == [4, 4, 4]
    ahead = s.schedule_ahead(batch)  # 5 tokens each: one new block per row, 8 free
    assert ahead is not None and ahead.decode_batch is batch
    assert [mgr.num_tokens(i) for i in range(3)] == [5, 5, 5] and mgr.num_free_blocks() == 5
    s.add(Request(9, [4], SamplingParams()))  # a waiting request: refused, nothing changes
    assert s.schedule_ahead(batch) is None and mgr.num_tokens(0) == 5
    s.waiting.clear()
    s.finish(reqs[1], "stop")  # the remembered batch changed
    assert s.schedule_ahead(batch) is None
    new_batch = s._decode
    for _ in range(3):  # 6, 7, 8 tokens: no new blocks
        assert s.schedule_ahead(new_batch) is not None
    free = mgr.num_free_blocks()
    assert free == 7
    mgr.add_request(50, list(range(4 * 6)))  # leaves one free block for two rows: refused
    assert mgr.num_free_blocks() == 1
    assert s.schedule_ahead(new_batch) is None and mgr.num_tokens(0) == 8


def test_async_graph_path_on_cpu():
    """The CUDA-graph replay path (staging slots, device tokens copied over the staged input
    ids) with the CPU stand-in graphs of test_cuda_graphs: async on equals plain steps."""
    from test_cuda_graphs import _CpuGraphs as CpuGraphs

    rng = random.Random(7)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(4, 30), stop_token_ids=[3, 5, 8, 13])
              for _ in prompts]  # fmt: skip
    kw = dict(backend="block_offsets", block_size=4, max_num_seqs=8, max_model_len=64)
    plain = LLM(CFG, async_scheduling=False, **kw)
    want = [(o.token_ids, o.finish_reason) for o in plain.generate(prompts, params)]
    llm = LLM(CFG, async_scheduling=True, **kw)
    parts = llm.parts
    graphs = CpuGraphs(parts.model, parts.metadata, parts.manager, 8, 64)
    graphs.capture_all()
    llm.engine.runner.graphs = graphs
    got = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    assert got == want
    assert graphs.num_replays > 0 and llm.engine.num_steps_ahead > 5
    # steps ahead were fed the graph's captured argmax (its static buffer)
    assert llm.engine.num_graph_argmax_steps == graphs.num_replays
    assert parts.manager.num_free_blocks() == parts.num_blocks - 1


def test_schedule_ahead_needs_a_free_block_per_row():
    mgr = KVCacheManager(8, 4, max_blocks_per_seq=8)  # 7 usable blocks
    s = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(2):
        s.add(Request(i, [1, 2, 3], SamplingParams(max_tokens=20)))
    out = run_schedules(s, 2, 5)[-1]
    batch = out.decode_batch  # 4 tokens each: the next step needs a new block per row
    assert batch is not None and mgr.num_free_blocks() == 5
    mgr.add_request(91, [7] * 16)  # 4 blocks: 1 free block left for 2 rows
    assert s.schedule_ahead(batch) is None and mgr.num_tokens(0) == 4  # nothing changed
    assert mgr.num_free_blocks() == 1
    mgr.free(91)
    assert s.schedule_ahead(batch) is not None and mgr.num_tokens(0) == 5
    assert mgr.num_tokens(1) == 5 and mgr.num_free_blocks() == 3


@pytest.mark.gpu
def test_async_equals_sync_with_cuda_graphs():
    """Same workloads on the GPU with CUDA graphs (fp32): the lookahead feeds the graph's
    input buffer from the device tokens."""
    for seed, blocks, seqs in ((1, 200, 16), (3, 24, 6)):
        on, off, _ = _run_on_off(seed, num_blocks=blocks, max_num_seqs=seqs, device="cuda",
                              dtype="float32")  # fmt: skip
        assert on.runner.graphs is not None and on.runner.graphs.num_replays > 0
        assert on.num_steps_ahead > 0 and off.runner.graphs.num_replays > 0
