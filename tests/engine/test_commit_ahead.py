"""A step's K/V at host-known tokens (prompt chunks, decode rows' inputs) is committed before
the host waits for the step's sampled tokens, so its block hashing overlaps the device's work;
verification rows commit after the wait (what they accept). Checked by recording, at the wait,
each row's committed count, on chunked prompts mixed with decode rows."""

from __future__ import annotations

import pytest

from kvplan import LLM, SamplingParams


def test_prompt_chunks_and_decode_rows_committed_before_the_wait():
    llm = LLM("random:tiny-llama", device="cpu", block_size=4, max_num_batched_tokens=24)
    core = llm.engine
    manager = core.scheduler.manager
    seen: list[tuple[int, int, int]] = []  # (request id, committed at the wait, expected)
    expected: dict[int, int] = {}
    update, wait = core._update_rows, core._copies.wait

    def recording_update(step, inputs, pending, logprobs=None):
        expected.clear()
        for s in step.seqs:
            rid = s.request.request_id
            n = s.num_query_tokens if s.is_prefill else 1
            expected[rid] = manager.num_committed_tokens(rid) + n
        try:
            return update(step, inputs, pending, logprobs)
        finally:
            expected.clear()  # the decode fast path's waits are not this loop's

    def recording_wait(pending):
        for rid, want in expected.items():
            seen.append((rid, manager.num_committed_tokens(rid), want))
        return wait(pending)

    core._update_rows, core._copies.wait = recording_update, recording_wait
    core.decode_fast_path = False  # decode-only steps take the row loop too
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 58)), list(range(100, 131)), [5, 6, 7]]
    outs = llm.generate(prompts, params)
    assert core.num_fast_decode_steps == 0
    assert len(seen) >= 20
    assert sum(got == want == m for m in (6, 7, 8) for _, got, want in seen)  # decode rows
    assert all(got == want for _, got, want in seen), seen
    assert {rid for rid, _, _ in seen} == {0, 1, 2}
    assert all(len(o.token_ids) == 6 for o in outs)


def test_a_failed_wait_forgets_the_prefix_hashes():
    """Blocks committed ahead of a wait that raises may name K/V the device never wrote: the
    prefix cache forgets every hash, so no later prompt reuses them; the engine stays usable."""
    llm = LLM("random:tiny-llama", device="cpu", block_size=4)
    core = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 30))
    llm.generate([prompt], params)
    pools = core.scheduler.manager.pools
    assert any(p.cached_blocks() for p in pools)
    wait = core._copies.wait

    def failing(pending):
        raise RuntimeError("device error")

    core._copies.wait = failing
    llm.add_request(list(range(50, 80)), params)
    with pytest.raises(RuntimeError, match="device error"):
        llm.step()
    assert not any(p.cached_blocks() for p in pools)
    core._copies.wait = wait
    assert llm.engine.requests == {}  # the step's request finished with "error"
    again = llm.generate([prompt], params)[0]
    assert core.scheduler.manager.prefix_cache.stats().num_hit_tokens == 0
    assert len(again.token_ids) == 2
