"""Prefix hits with a small window pool: a match needs the window pool's blocks only where the
new request's first computed query can see them (columns >= lo), not the released ones."""

from kvplan.cache import KVCacheManager
from kvplan.cache.block_pool import hash_prompt_blocks

BS, W = 4, 8


def _manager(window_blocks: int) -> KVCacheManager:
    return KVCacheManager.from_layer_windows(
        [window_blocks, 64], BS, [W, None], max_blocks_per_seq=16, release_out_of_window=True
    )


def _run(m, rid, prompt, chunk=4):
    assert m.add_request(rid, prompt, max_new_tokens=chunk).ok
    done = m.num_committed_tokens(rid)
    while done < len(prompt):
        end = min(len(prompt), done + chunk)
        assert m.prepare_chunk(rid, end).ok
        m.commit_tokens(rid, prompt[done:end])
        done = end


def test_hit_survives_eviction_of_released_window_blocks():
    m = _manager(window_blocks=6)  # 5 usable: early released blocks are evicted
    prompt = list(range(100, 140))  # 10 full blocks
    _run(m, "a", prompt)
    a_window = m.get_block_ids("a", 0)
    assert a_window[:5] == [0] * 5  # released
    m.free("a")
    hashes = hash_prompt_blocks(prompt, BS, 10)
    assert m.pools[0].lookup(hashes[0]) is None  # evicted: all-pools matching would stop at 0
    result = m.add_request("b", prompt + [1, 2])
    assert result.ok and result.num_cached_tokens == 40
    lo = (40 - W + 1) // BS  # 8: a query at position 40 sees keys >= 33
    b_window = m.get_block_ids("b", 0)
    assert b_window[:lo] == [0] * lo and all(b_window[lo:10])
    assert b_window[lo:10] == a_window[lo:10]  # A's cached blocks taken back
    assert m.get_block_ids("b", 1)[:10] == [
        m.pools[1].lookup(h) for h in m.requests.get("b").hashes
    ]


def test_hit_stops_where_the_window_pool_misses():
    """A window block the first query needs is gone: the run shrinks to where it holds."""
    m = _manager(window_blocks=6)
    prompt = list(range(100, 140))
    _run(m, "a", prompt)
    m.free("a")
    hashes, _ = m.prefix_cache.match(prompt + [1])
    m.pools[0].reset_prefix_cache()  # every window block forgotten
    hashes_after, blocks_after = m.prefix_cache.match(prompt + [1])
    assert len(hashes) == 10
    # with no window block cached, only runs whose first query sees nothing cached survive:
    # j with max(0, 4j - 7) // 4 >= j, i.e. j = 0
    assert hashes_after == [] and blocks_after == []
