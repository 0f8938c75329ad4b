"""BlockPool: exact block ids, ref counts, free-list order, prefix-cache eviction."""

import pytest

from kvplan.cache.block_pool import BlockPool, hash_block_tokens, hash_prompt_blocks


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0


def test_allocate_failure_changes_nothing():
    pool = BlockPool(4)
    assert pool.allocate(4) is None
    assert pool.free_block_ids() == [1, 2, 3]
    assert pool.allocate(0) == []


def test_free_order_uncached_front_cached_back():
    pool = BlockPool(6)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.cache_block(1, b"h1")
    assert pool.cache_block(3, b"h3")
    pool.free([3, 2, 1])
    # uncached 2 goes to the front; cached 3 then 1 go to the back in freeing order
    assert pool.free_block_ids() == [2, 4, 5, 3, 1]
    assert pool.lookup(b"h1") == 1 and pool.lookup(b"h3") == 3


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"b") is None  # evicted
    assert pool.lookup(b"a") == a and pool.lookup(b"c") == c
    assert pool.allocate(1) == [a]
    assert pool.lookup(b"a") is None


def test_touch_revives_cached_free_block():
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"x")
    pool.free([blk])
    assert pool.is_free(blk)
    pool.touch([blk, blk])
    assert not pool.is_free(blk) and pool.ref_count(blk) == 2
    assert pool.lookup(b"x") == blk
    pool.free([blk])
    assert pool.ref_count(blk) == 1 and not pool.is_free(blk)
    pool.free([blk])
    assert pool.free_block_ids()[-1] == blk


def test_double_free_and_bad_ids_raise():
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(ValueError, match="double free"):
        pool.free([blk])
    (blk,) = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free([blk, blk])
    assert pool.ref_count(blk) == 1  # the failed free changed nothing
    with pytest.raises(ValueError, match="padding block"):
        pool.free([0])
    with pytest.raises(ValueError, match="outside"):
        pool.touch([4])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_cache_block_keeps_first_owner_of_a_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")
    assert pool.lookup(b"h") == a and pool.block_hash(b) is None


def test_prefix_caching_disabled():
    pool = BlockPool(4, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, b"h")
    assert pool.lookup(b"h") is None


def test_chained_hash_depends_on_prefix():
    h1 = hash_prompt_blocks([1, 2, 3, 4], 2, 2)
    h2 = hash_prompt_blocks([9, 2, 3, 4], 2, 2)
    assert h1[1] != h2[1]  # same second block, different first block
    assert h1[1] == hash_block_tokens(h1[0], [3, 4])
    assert len({*h1, *h2}) == 4


def test_random_ops_against_a_list_model():
    """The free list behaves like a plain list: pop from the front, uncached blocks pushed to
    the front and cached ones to the back when their last reference goes."""
    import numpy as np

    rng = np.random.default_rng(0)
    pool = BlockPool(9)
    free = list(range(1, 9))
    refs = {b: 0 for b in range(1, 9)}
    hashes = {}  # block -> hash
    for step in range(500):
        op = rng.integers(4)
        if op == 0:
            n = int(rng.integers(0, 4))
            got = pool.allocate(n)
            if n > len(free):
                assert got is None
                continue
            want, free = free[:n], free[n:]
            for b in want:
                hashes.pop(b, None)
                refs[b] = 1
            assert got == want
        elif op == 1:
            used = [b for b in refs if refs[b] > 0]
            if used:
                b = int(rng.choice(used))
                pool.free([b])
                refs[b] -= 1
                if refs[b] == 0:
                    free = free + [b] if b in hashes else [b] + free
        elif op == 2:
            used = [b for b in refs if refs[b] > 0 and b not in hashes]
            if used:
                b = int(rng.choice(used))
                h = bytes([step % 256, step // 256])
                assert pool.cache_block(b, h)
                hashes[b] = h
        else:
            if hashes:
                b = int(rng.choice(list(hashes)))
                assert pool.lookup(hashes[b]) == b
                pool.touch([b])
                if refs[b] == 0:
                    free.remove(b)
                refs[b] += 1
        assert pool.free_block_ids() == free
        assert all(pool.ref_count(b) == refs[b] for b in refs)
        # allocation evicts exactly the popped blocks' hashes
        assert pool.num_cached_blocks == len(hashes)
        assert all(pool.lookup(h) == b and pool.block_hash(b) == h for b, h in hashes.items())
