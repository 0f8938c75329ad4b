"""Scheduler decisions on a real KVCacheManager (no model): budget, order, chunks, preemption."""

from __future__ import annotations

import pytest

from kvplan.cache import KVCacheManager
from kvplan.engine.request import Request, RequestStatus
from kvplan.engine.sampling import SamplingParams
from kvplan.engine.scheduler import Scheduler


def _req(i, n):
    return Request(i, list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=50))


def _advance(sched_out):
    """What the engine does after a step: computed tokens grow, sampling rows get a token."""
    for s in sched_out.seqs:
        r = s.request
        samples = s.samples
        r.num_computed_tokens += s.num_query_tokens
        if samples:
            r.output_token_ids.append(7)


def test_chunked_prefill_mixed_with_decode_under_budget():
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=10, max_num_seqs=8)
    a, b = _req(0, 3), _req(1, 25)
    s.add(a)
    s.add(b)
    out = s.schedule()  # a whole (3), b's first chunk (7)
    assert [(x.request.request_id, x.num_query_tokens, x.is_prefill) for x in out.seqs] == [
        (0, 3, True), (1, 7, True)]  # fmt: skip
    assert out.num_contexts == 2 and out.num_tokens == 10
    _advance(out)
    out = s.schedule()  # b continues (contexts first), a decodes
    assert [(x.request.request_id, x.num_query_tokens, x.is_prefill) for x in out.seqs] == [
        (1, 9, True), (0, 1, False)]  # fmt: skip
    assert out.num_contexts == 1
    assert not out.seqs[0].samples
    _advance(out)
    out = s.schedule()
    assert [(x.request.request_id, x.num_query_tokens) for x in out.seqs] == [(1, 9), (0, 1)]
    assert out.seqs[0].samples  # b's last chunk samples its first token
    assert mgr.num_tokens(0) == 5  # a: 3 prompt tokens + 2 decode steps


def test_whole_prompts_when_chunking_is_off():
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=10, max_num_seqs=8, enable_chunked_prefill=False)
    s.add(_req(0, 6))
    s.add(_req(1, 6))
    out = s.schedule()
    assert [x.num_query_tokens for x in out.seqs] == [6]
    with pytest.raises(ValueError, match="chunked prefill is off"):
        s.add(_req(2, 11))


def test_preemption_by_recompute_keeps_every_request():
    # 6 usable blocks of 4 tokens; three 8-token prompts take all of them
    mgr = KVCacheManager(7, 4, max_blocks_per_seq=8, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = [_req(i, 8) for i in range(3)]
    for r in reqs:
        s.add(r)
    _advance(s.schedule())
    out = s.schedule()  # request 0 needs a new block: the latest admitted (2) is preempted
    assert [r.request_id for r in out.preempted] == [2]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed_tokens == 0
    assert s.waiting[0] is reqs[2]
    assert [x.request.request_id for x in out.seqs] == [0, 1]
    assert reqs[2].output_token_ids == [7]  # generated tokens are kept for the recompute
    _advance(out)
    for r in reqs[:2]:
        s.finish(r, "length")
    out = s.schedule()  # readmitted: prompt + generated token are prefilled together
    assert [(x.request.request_id, x.num_query_tokens) for x in out.seqs] == [(2, 9)]
    assert mgr.num_free_blocks() == 6 - 3


def test_max_num_seqs_limits_admission():
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        s.add(_req(i, 2))
    assert len(s.schedule().seqs) == 2
    assert len(s.waiting) == 1


def test_resume_block_size_ends_a_prompt_chunk_at_its_last_boundary():
    """``resume_block_size``: a chunk that would cross ``(len - 1) // size * size`` ends
    there (the family snapshots its state), whatever the budget; shorter chunks, chunks
    that end on it and prompts of at most one block are unchanged."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, resume_block_size=8)
    a, b, c = _req(0, 21), _req(1, 8), _req(2, 30)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()  # a: 16 (not 21); b: one block, whole; c: 16 of the budget left
    assert [(x.request.request_id, x.num_query_tokens) for x in out.seqs] == [
        (0, 16), (1, 8), (2, 16)]  # fmt: skip
    _advance(out)
    out = s.schedule()  # a's 5; c: 16 -> 24 ends on its boundary (29 // 8 * 8), then 6
    assert [(x.request.request_id, x.num_query_tokens) for x in out.seqs] == [
        (0, 5), (2, 8), (1, 1)]  # fmt: skip
    _advance(out)
    out = s.schedule()
    assert [(x.request.request_id, x.num_query_tokens) for x in out.seqs] == [
        (2, 6), (0, 1), (1, 1)]  # fmt: skip
    plain = Scheduler(KVCacheManager(64, 4, max_blocks_per_seq=16), max_num_batched_tokens=40,
                      max_num_seqs=8)  # fmt: skip
    plain.add(_req(0, 21))
    assert plain.schedule().seqs[0].num_query_tokens == 21


def _commit(mgr, sched_out):
    """`_advance`, plus the manager's commit of every computed prompt token."""
    for s in sched_out.seqs:
        r = s.request
        if s.is_prefill:
            start = r.num_computed_tokens
            mgr.commit_tokens(r.request_id, r.all_token_ids[start : start + s.num_query_tokens])
    _advance(sched_out)


def _rows(out):
    return [(x.request.request_id, x.num_query_tokens) for x in out.seqs]


def _shared(i, system, n):
    return Request(i, system + list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=50))


@pytest.mark.parametrize("wait", [True, False])
def test_a_prompt_waits_for_the_shared_blocks_another_request_computes(wait):
    """Two prompts sharing 12 tokens (3 blocks) arrive together: the second waits for the
    first one's blocks (a request behind it is admitted past it), then reuses them."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, wait_for_shared_prefix=wait)
    system = list(range(1000, 1012))
    a, b, c = _shared(0, system, 5), _shared(1, system, 6), _req(2, 10)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    if not wait:
        assert _rows(out) == [(0, 17), (1, 18), (2, 5)] and s.num_prefix_waits == 0
        return
    assert _rows(out) == [(0, 17), (2, 10)] and list(s.waiting) == [b]
    assert s.num_prefix_waits == 1 == s.num_waiting_for_prefix
    _commit(mgr, out)
    out = s.schedule()
    assert b.num_cached_prefix_tokens == 12 and s.num_waiting_for_prefix == 0
    assert _rows(out) == [(1, 6), (0, 1), (2, 1)]


def test_the_owner_chunk_ends_where_the_waiting_prompt_shared_run_ends():
    """With ``resume_block_size`` (per-sequence state kept at chunk ends) the owner's chunk
    is cut where the shared run ends -- this step's already scheduled chunk too -- so the
    waiting prompt can resume there; the freed budget goes to the next waiting request."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, resume_block_size=4)
    system = list(range(1000, 1010))  # 2 full blocks shared
    a, b, c = _shared(0, system, 13), _shared(1, system, 6), _req(2, 30)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()  # a: 8 (not its own boundary 20); b waits; c: 28 of the 32 left
    assert _rows(out) == [(0, 8), (2, 28)] and a.shared_ends == [8]
    _commit(mgr, out)
    out = s.schedule()  # a and b to their own boundaries (20, 12); b resumes at 8
    assert _rows(out) == [(0, 12), (2, 2), (1, 4)]
    assert b.num_cached_prefix_tokens == 8


def test_waiting_prompts_move_on_when_the_owner_leaves_and_never_wait_for_logprobs():
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=12, max_num_seqs=8)
    system = list(range(1000, 1016))
    a, b = _shared(0, system, 8), _shared(1, system, 3)
    logprobs = Request(2, system + [5, 6], SamplingParams(max_tokens=5, prompt_logprobs=1))
    for r in (a, b, logprobs):
        s.add(r)
    out = s.schedule()  # a's first chunk; b waits; the logprobs prompt reuses nothing
    assert _rows(out) == [(0, 12)] and list(s.waiting) == [b, logprobs]
    s.finish(a, "abort")  # a leaves before committing: nothing is pending any more
    assert mgr.prefix_cache.pending == {}
    out = s.schedule()
    assert _rows(out) == [(1, 12)] and b.num_cached_prefix_tokens == 0
    _commit(mgr, out)
    out = s.schedule()
    assert _rows(out) == [(1, 7), (2, 5)] and logprobs.num_cached_prefix_tokens == 0


def test_a_prompt_the_budget_did_not_reach_still_cuts_the_owner_chunk():
    """The budget runs out on the owner's chunk before the sharing prompt is looked at: the
    next waiting request is still checked, and the owner's later chunk ends at the shared
    run's end (12, not its own boundary 20); the prompt then waits for it and resumes there."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=10, max_num_seqs=8, resume_block_size=4)
    system = list(range(1000, 1012))  # 3 full blocks shared
    a, b = _shared(0, system, 9), _shared(1, system, 5)
    s.add(a)
    s.add(b)
    out = s.schedule()  # the budget ends a's chunk at 10; b is not reached, but looked up
    assert _rows(out) == [(0, 10)] and a.shared_ends == [12] and s.num_prefix_waits == 0
    _commit(mgr, out)
    out = s.schedule()  # a to the shared end; b waits for block 2
    assert _rows(out) == [(0, 2)] and list(s.waiting) == [b] and s.num_prefix_waits == 1
    _commit(mgr, out)
    out = s.schedule()  # a to its own boundary; b resumes at 12
    assert _rows(out) == [(0, 8), (1, 2)] and b.num_cached_prefix_tokens == 12
    plain = Scheduler(KVCacheManager(64, 4, max_blocks_per_seq=16), max_num_batched_tokens=10,
                      max_num_seqs=8, resume_block_size=4, wait_for_shared_prefix=False)  # fmt: skip
    plain.add(_shared(0, system, 9))
    plain.add(_shared(1, system, 5))
    assert _rows(plain.schedule()) == [(0, 10)] and plain.running[0].shared_ends == []


def _kept(out):
    return [(x.request.request_id, x.num_query_tokens, x.keep_state_at) for x in out.seqs]


def test_keep_state_in_chunk_names_the_boundaries_instead_of_cutting():
    """``keep_state_in_chunk``: the chunks of the cut test above run whole, each prefill row
    naming the boundaries of `_keep_points` strictly inside it (its last boundary below its
    length), decode rows none."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16, enable_prefix_caching=False)
    s = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, resume_block_size=8,
                  keep_state_in_chunk=True)  # fmt: skip
    a, b, c = _req(0, 21), _req(1, 8), _req(2, 30)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()  # a whole (16 inside); b: one block, nothing inside; c: 11 of 40
    assert _kept(out) == [(0, 21, (16,)), (1, 8, ()), (2, 11, ())]
    _advance(out)
    out = s.schedule()  # c's 19 left pass its boundary 24
    assert _kept(out) == [(2, 19, (24,)), (0, 1, ()), (1, 1, ())]
    off = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, keep_state_in_chunk=True)
    assert not off.keep_state_in_chunk  # nothing to keep without resume_block_size


def test_keep_state_in_chunk_names_the_shared_run_end_in_the_owner_chunk():
    """The owner-cut test above with ``keep_state_in_chunk``: the owner's scheduled chunk
    keeps its length and names the shared run's end (8) besides its own boundary (20); the
    waiting prompt resumes at 8 once the blocks are committed."""
    mgr = KVCacheManager(64, 4, max_blocks_per_seq=16)
    s = Scheduler(mgr, max_num_batched_tokens=40, max_num_seqs=8, resume_block_size=4,
                  keep_state_in_chunk=True)  # fmt: skip
    system = list(range(1000, 1010))  # 2 full blocks shared
    a, b, c = _shared(0, system, 13), _shared(1, system, 6), _req(2, 30)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()  # a whole: 23 tokens, 8 and 20 inside; b waits; c: 17 of 40
    assert _kept(out) == [(0, 23, (8, 20)), (2, 17, ())] and a.shared_ends == [8]
    _commit(mgr, out)
    out = s.schedule()
    assert _rows(out) == [(2, 13), (1, 8), (0, 1)] and b.num_cached_prefix_tokens == 8
