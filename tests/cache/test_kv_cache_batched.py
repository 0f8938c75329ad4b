"""KVCacheManager.extend_many / commit_tokens_many: exact ids, hashes, out-of-blocks results,
caller errors, and equality with the per-request calls on random operation sequences."""

import numpy as np
import pytest

from kvplan.cache import AllocationResult, KVCacheManager, hash_block_tokens
from kvplan.cache.kv_cache_manager import BatchAllocationResult


def make(num_blocks=16, block_size=4, max_blocks_per_seq=8, **kw):
    return KVCacheManager(num_blocks, block_size, max_blocks_per_seq=max_blocks_per_seq, **kw)


def snapshot(m):
    """Everything observable: free lists (in order), hashes, ref counts, every request's
    lengths, hash chain and block ids (all pools, beams, cross blocks)."""
    out = [
        (
            p.free_block_ids(),
            sorted(p.cached_blocks().items()),
            [p.ref_count(b) for b in range(1, p.num_blocks)],
        )
        for p in m.pools
    ]
    for rid in sorted(m.request_ids(), key=repr):
        req = m.requests.get(rid)
        blocks = [
            m.get_block_ids(rid, p, beam=b)
            for p in range(m.num_pools)
            for b in range(req.beam_width)
        ]
        out.append((rid, m.num_tokens(rid), m.num_committed_tokens(rid), list(req.hashes), blocks))
    return out


def test_extend_many_exact_ids_and_lengths():
    m = make(num_blocks=8)
    m.add_request("a", [1, 2, 3, 4])  # [1]
    m.add_request("b", [5, 6])  # [2]
    m.add_request("c", [7, 8, 9, 10, 11])  # [3, 4]
    assert m.extend_many(["a", "b", "c"], 1) == BatchAllocationResult(3)
    assert [m.get_block_ids(r) for r in "abc"] == [[1, 5], [2], [3, 4]]
    assert [m.num_tokens(r) for r in "abc"] == [5, 3, 6]
    r = m.extend_many(("c", "b", "a"), [3, 2, 0])  # c: 9 -> [3, 4, 6]; b: 5 -> [2, 7]
    assert r.ok and r.num_extended == 3
    assert [m.get_block_ids(r) for r in "abc"] == [[1, 5], [2, 7], [3, 4, 6]]
    assert [m.num_tokens(r) for r in "abc"] == [5, 5, 9]
    assert m.extend_many([], 1) == BatchAllocationResult(0)


def test_extend_many_stops_at_the_first_request_without_blocks():
    m = make(num_blocks=6)  # blocks 1..5
    for rid in "abc":
        m.add_request(rid, [1, 2, 3, 4])  # a [1], b [2], c [3]; free [4, 5]
    m.extend("c", 0)
    r = m.extend_many(["a", "b", "c"], [1, 5, 1])  # a +1 block, b +2 blocks: only 1 left
    assert r == BatchAllocationResult(1, AllocationResult(False, 0, 1, "blocks", (1,)))
    assert not r.ok and r.failure.num_missing_blocks == 1
    assert [m.get_block_ids(x) for x in "abc"] == [[1, 4], [2], [3]]
    assert [m.num_tokens(x) for x in "abc"] == [5, 4, 4]  # b and c unchanged
    # requests that need no block still count as "extended" before the failing one
    r = m.extend_many(["a", "c", "b"], [1, 0, 5])
    assert (r.num_extended, r.failure.num_missing_blocks) == (2, 1)
    assert [m.num_tokens(x) for x in "abc"] == [6, 4, 4]


def test_commit_tokens_many_hashes_full_blocks_for_prefix_reuse():
    m = make(num_blocks=16)
    prompt = [3, 1, 4, 1, 5, 9]  # block 0 = [3, 1, 4, 1], partial [5, 9]
    m.add_request("a", prompt)  # [1, 2]
    m.add_request("b", [2, 7])  # [3]
    m.commit_tokens("a", prompt)
    m.commit_tokens("b", [2, 7])
    gen_a, gen_b = [2, 6, 5, 3], [1, 8]
    for t in range(2):
        assert m.extend_many(["a", "b"], 1).ok
        m.commit_tokens_many(["a", "b"], np.array([gen_a[t], gen_b[t]]))
    # a: block 1 = [5, 9, 2, 6] filled by the batched commits; b: block 0 = [2, 7, 1, 8]
    h0 = hash_block_tokens(None, [3, 1, 4, 1])
    h1 = hash_block_tokens(h0, [5, 9, 2, 6])
    hb = hash_block_tokens(None, [2, 7, 1, 8])
    assert m.requests.get("a").hashes == [h0, h1] and m.requests.get("b").hashes == [hb]
    assert (m.pools[0].lookup(h1), m.pools[0].lookup(hb)) == (2, 3)
    r = m.add_request("c", [3, 1, 4, 1, 5, 9, 2, 6, 0])
    assert r.num_cached_tokens == 8 and m.get_block_ids("c")[:2] == [1, 2]
    r = m.add_request("d", [2, 7, 1, 8, 0])
    assert r.num_cached_tokens == 4 and m.get_block_ids("d")[0] == 3
    assert m.num_committed_tokens("a") == 8 and m.num_committed_tokens("b") == 4


def test_commit_tokens_many_prompt_positions_one_at_a_time():
    m = make()
    m.add_request("a", [4, 5, 6, 7, 8])
    m.add_request("b", [1, 2])
    m.commit_tokens_many(["a", "b"], [4, 1])  # prompt tokens may be committed in batches too
    m.commit_tokens_many(["a", "b"], [5, 2])
    m.extend("b", 1)
    with pytest.raises(ValueError, match="differ from the prompt"):
        m.commit_tokens_many(["b", "a"], [0, 9])  # b's position 2 is past its prompt: fine
    assert (m.num_committed_tokens("a"), m.num_committed_tokens("b")) == (2, 2)
    m.commit_tokens_many(["b", "a"], [0, 6])
    assert (m.num_committed_tokens("a"), m.num_committed_tokens("b")) == (3, 3)


def test_batched_caller_errors_change_nothing():
    m = make(num_blocks=32, max_blocks_per_seq=3)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [1, 2, 3, 4, 5])
    m.commit_tokens("a", [1, 2, 3])
    before = snapshot(m)
    cases = [
        (m.extend_many, (["a", "zz"], 1), "unknown request id"),
        (m.extend_many, (["a", "b", "a"], 1), "more than once"),
        (m.extend_many, (["a", "b"], [1, -1]), "must be >= 0"),
        (m.extend_many, (["a", "b"], [1, 2, 3]), "shape"),
        (m.extend_many, (["a", "b"], [1, 8]), "max_blocks_per_seq"),
        (m.commit_tokens_many, (["b", "a"], [1, 9]), "exceeds the logical length"),
        (m.commit_tokens_many, (["b", "b"], [1, 1]), "more than once"),
        (m.commit_tokens_many, (["b"], [1, 2]), "shape"),
    ]
    for fn, args, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args)
        assert snapshot(m) == before, match
    with pytest.raises(TypeError, match="dtype"):
        m.extend_many(["a"], [1.5])


def _apply_per_request_extend(m, ids, counts):
    for i, rid in enumerate(ids):
        r = m.extend(rid, int(counts if np.ndim(counts) == 0 else counts[i]))
        if not r.ok:
            return BatchAllocationResult(i, r)
    return BatchAllocationResult(len(ids))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(window_sizes=(None, 6), layer_to_pool=[0, 1], release_out_of_window=True),
        dict(window_sizes=(None, 6), layer_to_pool=[0, 1], max_beam_width=2),
    ],
    ids=["prefix", "no-prefix", "windows-release", "windows-beams"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_calls_equal_per_request_calls(kw, seed):
    """Two managers see the same random operations; one gets extend_many /
    commit_tokens_many, the other the per-request loop. Every result and all state agree."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([2, 4]))
    num_pools = len(kw.get("window_sizes", (None,)))
    batched, looped = (make([30] * num_pools, bs, **kw) for _ in range(2))
    tokens: dict[int, list[int]] = {}
    bases = [rng.integers(0, 4, 12).tolist() for _ in range(2)]  # shared prefixes: hits
    next_id = 0
    for _ in range(250):
        op = rng.choice(["add", "extend", "commit", "commit", "free"])
        active = list(tokens)
        if op == "add" or not active:
            prompt = (
                bases[rng.integers(2)][: rng.integers(1, 10)]
                + rng.integers(0, 4, rng.integers(0, 4)).tolist()
            )
            width = int(rng.integers(1, kw.get("max_beam_width", 1) + 1))
            results = [x.add_request(next_id, prompt, beam_width=width) for x in (batched, looped)]
            assert results[0] == results[1]
            if results[0].ok:
                tokens[next_id] = list(prompt)
            next_id += 1
        elif op == "free":
            rid = active[rng.integers(len(active))]
            batched.free(rid)
            looped.free(rid)
            del tokens[rid]
        else:
            ids = [active[i] for i in rng.permutation(len(active))[: rng.integers(1, 7)]]
            if op == "extend":
                counts = rng.integers(0, 3, len(ids)) if rng.integers(2) else int(rng.integers(3))
                room = [batched.max_seq_len - batched.num_tokens(r) for r in ids]
                if np.any(np.broadcast_to(counts, len(ids)) > room):
                    continue  # too long: a caller error (tested above)
                got = batched.extend_many(ids, counts)
                assert got == _apply_per_request_extend(looped, ids, counts)
            else:
                ids = [r for r in ids if looped.num_committed_tokens(r) < looped.num_tokens(r)]
                new = []
                for rid in ids:  # the token at the next committed position (prompt, then new)
                    pos = looped.num_committed_tokens(rid)
                    if pos == len(tokens[rid]):
                        tokens[rid].append(int(rng.integers(0, 4)))
                    new.append(tokens[rid][pos])
                batched.commit_tokens_many(ids, new)
                for rid, t in zip(ids, new):
                    looped.commit_tokens(rid, [t])
        assert snapshot(batched) == snapshot(looped)
    assert batched.prefix_cache_stats() == looped.prefix_cache_stats()
