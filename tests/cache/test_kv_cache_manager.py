"""KVCacheManager: exact block ids for every lifecycle step (CPU, integers only)."""

import numpy as np
import pytest

from kvplan.cache import AllocationResult, KVCacheManager


def make(num_blocks=16, block_size=4, max_blocks_per_seq=8, **kw):
    return KVCacheManager(num_blocks, block_size, max_blocks_per_seq=max_blocks_per_seq, **kw)


def test_add_extend_free_exact_ids():
    m = make(num_blocks=8)
    r = m.add_request("a", [1, 2, 3, 4, 5])
    assert r == AllocationResult(True, 0, 0)
    assert m.get_block_ids("a") == [1, 2]
    assert m.num_tokens("a") == 5 and m.num_logical_blocks("a") == 2
    assert m.extend("a", 3).ok and m.get_block_ids("a") == [1, 2]  # 8 tokens still 2 blocks
    assert m.extend("a", 1).ok and m.get_block_ids("a") == [1, 2, 3]
    assert m.num_free_blocks() == 4
    m.add_request("b", [7] * 4)
    assert m.get_block_ids("b") == [4]
    m.free("a")
    assert m.num_free_blocks() == 6
    with pytest.raises(ValueError, match="unknown request id"):
        m.free("a")
    with pytest.raises(ValueError, match="unknown request id"):
        m.extend("zz", 1)
    with pytest.raises(ValueError, match="already active"):
        m.add_request("b", [1])


def test_out_of_blocks_is_typed_and_changes_nothing():
    m = make(num_blocks=4)
    assert m.add_request("a", list(range(8))).ok  # blocks 1, 2
    before = m.pools[0].free_block_ids()
    r = m.add_request("b", list(range(9)))  # needs 3, one free
    assert r == AllocationResult(False, 0, 2, "blocks", (2,))
    assert not m.has_request("b") and m.pools[0].free_block_ids() == before
    r = m.extend("a", 9)  # 17 tokens -> 5 blocks, 3 more, 1 free
    assert (r.ok, r.num_missing_blocks) == (False, 2)
    assert m.num_tokens("a") == 8 and m.get_block_ids("a") == [1, 2]
    assert m.can_allocate(4) and not m.can_allocate(5)


def test_too_long_is_a_caller_error():
    m = make(max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        m.add_request("a", list(range(9)))
    m.add_request("a", list(range(8)))
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        m.extend("a", 1)


def test_prefix_reuse_after_commit():
    m = make(num_blocks=16)
    prompt = list(range(10))  # blocks: [0..3] [4..7] [8, 9]
    m.add_request("a", prompt)
    assert m.get_block_ids("a") == [1, 2, 3]
    # Nothing committed yet: a second identical prompt reuses nothing.
    assert m.add_request("b", prompt).num_cached_tokens == 0
    m.free("b")
    m.commit_tokens("a", prompt[:6])  # block 1 full and written
    r = m.add_request("c", prompt + [99])
    assert r.num_cached_tokens == 4
    assert m.get_block_ids("c")[0] == 1 and m.pools[0].ref_count(1) == 2
    m.commit_tokens("a", prompt[6:])
    r = m.add_request("d", prompt)
    assert r.num_cached_tokens == 8 and m.get_block_ids("d")[:2] == [1, 2]


def test_prefix_reuse_leaves_one_token_to_compute():
    m = make()
    prompt = list(range(8))
    m.add_request("a", prompt)
    m.commit_tokens("a", prompt)
    r = m.add_request("b", prompt)  # fully cached prompt: last block is recomputed
    assert r.num_cached_tokens == 4
    assert m.get_block_ids("b")[0] == m.get_block_ids("a")[0]
    assert m.get_block_ids("b")[1] != m.get_block_ids("a")[1]


def test_prefix_reuse_of_freed_blocks_and_eviction():
    m = make(num_blocks=5, block_size=2)  # 4 usable blocks
    prompt = [5, 6, 7, 8, 9]
    m.add_request("a", prompt)  # [1, 2, 3]
    m.commit_tokens("a", prompt)
    m.free("a")  # 3 (uncached tail) to the front, then 2, 1 to the back
    assert m.pools[0].free_block_ids() == [3, 4, 2, 1]
    r = m.add_request("b", prompt)
    assert r.num_cached_tokens == 4 and m.get_block_ids("b") == [1, 2, 3]
    m.free("b")
    m.add_request("c", [1, 1, 1, 1, 1, 1])  # takes 3, 4, then evicts 2 (freed before 1)
    assert m.get_block_ids("c") == [3, 4, 2]
    m.free("c")
    # block 2 lost its hash; block 1 (the first block of the chain) is still cached
    assert m.add_request("d", prompt).num_cached_tokens == 2
    assert m.get_block_ids("d")[0] == 1


def test_commit_checks():
    m = make()
    m.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="differ from the prompt"):
        m.commit_tokens("a", [1, 9])
    with pytest.raises(ValueError, match="logical length"):
        m.commit_tokens("a", [1, 2, 3, 4])
    m.commit_tokens("a", [1, 2, 3])
    m.extend("a", 1)
    m.commit_tokens("a", [42])
    assert m.num_committed_tokens("a") == 4


def test_reserve_rewind_release():
    m = make(num_blocks=16)
    m.add_request("a", list(range(5)))  # [1, 2]
    assert m.reserve("a", 8).ok  # 13 tokens -> 4 blocks
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    assert m.num_tokens("a") == 5 and m.num_logical_blocks("a") == 2
    assert m.num_allocated_blocks("a") == 4
    assert m.extend("a", 4).ok and m.get_block_ids("a") == [1, 2, 3, 4]  # consumes reserved
    m.rewind("a", 3)
    assert m.num_tokens("a") == 6
    assert m.release_reserved("a") == 2
    assert m.get_block_ids("a") == [1, 2]
    assert m.get_block_ids_per_seq(["a"])[0].tolist() == [1, 2, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="rewind"):
        m.rewind("a", 7)


def test_batch_views_agree():
    m = make(num_blocks=32)
    m.add_request("a", list(range(9)))
    m.add_request("b", list(range(3)))
    m.add_request("c", list(range(13)))
    ids = ["c", "a", "b"]
    per_seq = m.get_block_ids_per_seq(ids)
    assert per_seq.dtype == np.int32 and per_seq.shape == (3, 8)
    lists = m.get_batch_cache_indices(ids)
    assert lists == [m.get_block_ids(r) for r in ids]
    for row, blocks in zip(per_seq, lists):
        assert row[: len(blocks)].tolist() == blocks and not row[len(blocks) :].any()
    flat = m.get_batch_cache_indices_flat(ids)
    assert flat.dtype == np.int32 and flat.tolist() == sum(lists, [])
    trimmed = m.get_batch_cache_indices_flat(ids, [2, 1, 0])
    assert trimmed.tolist() == lists[0][:2] + lists[1][:1]
    with pytest.raises(ValueError, match="num_blocks_per_seq"):
        m.get_batch_cache_indices_flat(ids, [5, 1, 1])
    with pytest.raises(ValueError, match="unknown request id"):
        m.get_block_ids_per_seq(["a", "nope"])
