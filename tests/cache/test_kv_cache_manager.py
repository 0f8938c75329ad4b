"""KVCacheManager: exact block ids for every lifecycle step (CPU, integers only)."""

import numpy as np
import pytest

from kvplan.cache import AllocationResult, KVCacheManager


def make(num_blocks=16, block_size=4, max_blocks_per_seq=8, **kw):
    return KVCacheManager(num_blocks, block_size, max_blocks_per_seq=max_blocks_per_seq, **kw)


def test_block_ids_view_is_a_read_only_view_of_the_table():
    m = make(num_blocks=8)
    m.add_request("a", [1, 2, 3, 4, 5])
    view = m.get_block_ids_view("a")
    assert view.dtype == np.int32 and view.tolist() == m.get_block_ids("a") == [1, 2]
    assert not view.flags.writeable and not view.flags.owndata  # no copy
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 5
    assert m.extend("a", 4).ok
    assert m.get_block_ids_view("a").tolist() == m.get_block_ids("a") == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown request id"):
        m.get_block_ids_view("zz")


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
    stats = m.prefix_cache_stats()
    assert stats == (10 + 10 + 11 + 10, 4 + 8) and stats.hit_rate == 12 / 41
    m.reset_prefix_cache()
    assert m.add_request("e", prompt).num_cached_tokens == 0


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


def test_repeated_batch_lookups_follow_free_and_re_add():
    """The manager remembers the last batch's rows; freeing any request must forget them
    (its row may go to another request), and a re-added id must show its new blocks."""
    m = make(num_blocks=32)
    for rid, n in (("a", 9), ("b", 3), ("c", 13)):
        m.add_request(rid, list(range(n)))
    ids = ["c", "a", "b"]
    first = m.get_block_ids_per_seq(ids, width=4)
    assert m.get_block_ids_per_seq(list(ids), width=4).tolist() == first.tolist()  # cache hit
    m.free("a")
    m.add_request("d", list(range(5)))  # takes a's old row
    m.add_request("a", list(range(2)))  # new row, new blocks
    again = m.get_block_ids_per_seq(ids, width=4)
    want = [m.get_block_ids(r) + [0] * (4 - len(m.get_block_ids(r))) for r in ids]
    assert again.tolist() == want
    assert again[1].tolist() != first[1].tolist()
    assert m.get_batch_cache_indices(ids) == [m.get_block_ids(r) for r in ids]
    m.free("b")
    with pytest.raises(ValueError, match="unknown request id"):
        m.get_block_ids_per_seq(ids)
    rows = m.requests.seq_rows(["c", "a"], None)
    with pytest.raises(ValueError):
        rows[0] = 5  # shared with later lookups: read-only


def test_beams_share_full_prompt_blocks_only():
    m = make(num_blocks=32, max_beam_width=4)
    r = m.add_request("a", list(range(9)), beam_width=3)  # 2 full blocks + a partial one
    assert r.ok
    assert [m.get_block_ids("a", beam=b) for b in range(3)] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert m.pools[0].ref_count(1) == 3 and m.pools[0].ref_count(3) == 1
    assert m.beam_fork_copies("a") == [(0, 3, 4), (0, 3, 5)]
    m.extend("a", 3)  # 12 tokens: still 3 blocks per beam
    m.extend("a", 1)  # 13 tokens: one more block per beam
    assert [m.get_block_ids("a", beam=b)[3] for b in range(3)] == [6, 7, 8]
    assert m.get_block_ids_per_seq(["a", "a"], beams=[2, 0])[:, :4].tolist() == [
        [1, 2, 5, 8],
        [1, 2, 3, 6],
    ]
    m.free("a")
    assert m.num_free_blocks() == 31
    with pytest.raises(ValueError, match="beam_width"):
        m.add_request("b", [1], beam_width=5)
    m.add_request("c", list(range(8)), beam_width=2)  # no partial block: nothing to copy
    assert m.beam_fork_copies("c") == []
    with pytest.raises(ValueError, match="beam 2"):
        m.get_block_ids("c", beam=2)


def test_beam_out_of_blocks_counts_every_beam():
    m = make(num_blocks=6, max_beam_width=2)  # 5 usable
    m.add_request("a", list(range(6)), beam_width=2)  # shared [1], tails 2, 3
    r = m.extend("a", 4)  # 10 tokens: 3 blocks per beam -> 1 more each, 2 free
    assert r.ok
    r = m.extend("a", 4)  # 14 tokens: 4 blocks per beam -> 2 needed, 0 free
    assert r == AllocationResult(False, 0, 2, "blocks", (2,))


def test_cross_blocks_shared_by_beams():
    m = make(num_blocks=32, max_beam_width=2)
    m.add_request("a", [1, 2, 3], beam_width=2, num_encoder_tokens=10)
    assert m.get_cross_block_ids("a") == [3, 4, 5]
    assert m.get_block_ids("a", beam=0) == [1] and m.get_block_ids("a", beam=1) == [2]
    m.commit_tokens("a", [1, 2, 3])
    assert m.pools[0].num_cached_blocks == 0  # cross-attention requests are never cached
    m.free("a")
    assert m.num_free_blocks() == 31
    m.add_request("b", [1])
    assert m.get_cross_block_ids("b") == []


def test_vswa_pools_and_layer_map():
    m = KVCacheManager.from_layer_windows([16, 8], 4, [None, 64, None, 64], max_blocks_per_seq=4)
    assert m.num_pools == 2 and m.window_sizes == (None, 64)
    assert [m.pool_for_layer(i) for i in range(4)] == [0, 1, 0, 1]
    m.add_request("x", [9] * 4)
    m.add_request("a", list(range(6)))
    assert m.get_block_ids("a", pool=0) == [2, 3] and m.get_block_ids("a", pool=1) == [2, 3]
    assert m.get_batch_cache_indices(["a"], layer_idx=3) == [[2, 3]]
    r = m.extend("a", 10)  # 16 tokens: 4 blocks; pool 1 has 7 usable, 3 used -> fits
    assert r.ok and m.num_free_blocks(1) == 2 and m.num_free_blocks(0) == 10
    r = m.add_request("b", list(range(9)))  # 3 blocks: pool 1 short by 1
    assert r == AllocationResult(False, 0, 1, "blocks", (0, 1))
    assert m.num_free_blocks(0) == 10  # nothing taken from pool 0 either
    with pytest.raises(ValueError, match="layer_idx 7"):
        m.pool_for_layer(7)
    with pytest.raises(ValueError, match="layer_to_pool is required"):
        KVCacheManager(8, 4, max_blocks_per_seq=2, window_sizes=(None, 8))
    with pytest.raises(ValueError, match="distinct"):
        KVCacheManager(8, 4, max_blocks_per_seq=2, window_sizes=(8, 8), layer_to_pool=[0])


def test_vswa_prefix_hit_needs_every_pool():
    m = KVCacheManager(
        [16, 4], 2, max_blocks_per_seq=4, window_sizes=(None, 4), layer_to_pool=[0, 1]
    )
    m.add_request("a", [1, 2, 3])  # blocks [1, 2] in both pools
    m.commit_tokens("a", [1, 2, 3])
    m.free("a")
    m.add_request("fill", [7] * 6)  # pool 1 (3 usable blocks) must evict block 1's hash
    assert m.get_block_ids("fill", pool=0) == [2, 3, 4]
    assert m.get_block_ids("fill", pool=1) == [2, 3, 1]
    m.free("fill")
    assert m.pools[0].num_cached_blocks == 1 and m.pools[1].num_cached_blocks == 0
    assert m.add_request("b", [1, 2, 3]).num_cached_tokens == 0
    m.commit_tokens("b", [1, 2, 3])
    # pool 0 keeps its older copy (block 1), pool 1 now caches b's block: a hit again
    r = m.add_request("c", [1, 2, 9])
    assert r.num_cached_tokens == 2
    assert m.get_block_ids("c", pool=0)[0] == 1
    assert m.get_block_ids("c", pool=1)[0] == m.get_block_ids("b", pool=1)[0]


def test_state_slots():
    m = make(num_state_slots=2)
    m.add_request("a", [1])
    m.add_request("b", [1])
    assert (m.get_state_slot("a"), m.get_state_slot("b")) == (0, 1)
    r = m.add_request("c", [1])
    assert (r.ok, r.reason) == (False, "state_slots") and not m.has_request("c")
    free_before = m.num_free_blocks()
    assert free_before == 13
    m.free("a")
    assert m.add_request("c", [1]).ok and m.get_state_slot("c") == 0
    m0 = make()
    m0.add_request("z", [1])
    with pytest.raises(ValueError, match="num_state_slots = 0"):
        m0.get_state_slot("z")


def test_rows_grow_past_initial_capacity():
    m = make(num_blocks=400, max_blocks_per_seq=2)
    for i in range(150):
        assert m.add_request(i, [i, i + 1, i + 2, i + 3, i + 4]).ok
    table = m.get_block_ids_per_seq(list(range(150)))
    assert table[:, :2].tolist() == [[2 * i + 1, 2 * i + 2] for i in range(150)]


def check_invariants(m):
    """Ref counts equal the references held by active requests; free list = unreferenced."""
    from collections import Counter

    for p, pool in enumerate(m.pools):
        refs = Counter()
        for rid in m.request_ids():
            req = m.requests.get(rid)
            for b in range(req.beam_width):
                ids = m.get_block_ids(rid, p, beam=b)
                assert len(ids) >= m.num_logical_blocks(rid)
                if not m.release_out_of_window:
                    assert 0 not in ids
                refs.update(b for b in ids if b)
            refs.update(m.get_cross_block_ids(rid, p))
        for blk in range(1, pool.num_blocks):
            assert pool.ref_count(blk) == refs[blk], (p, blk)
            assert pool.is_free(blk) == (refs[blk] == 0), (p, blk)
        rows = [r for rid in m.request_ids() for r in m.requests.get(rid).rows]
        for row in rows:  # padding past the allocated count is block 0
            assert not m.requests.tables[p, row, m.requests.num_allocated[row] :].any()


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_kv_content_consistent(seed, release):
    """Simulate K/V writes into a fake cache: a prefix hit must find exactly the prompt's
    tokens in the reused blocks, and no active request's written tokens are ever lost."""
    rng = np.random.default_rng(seed)
    bs = 4
    m = KVCacheManager(
        [24, 20],
        bs,
        max_blocks_per_seq=8,
        window_sizes=(None, 8),
        layer_to_pool=[0, 1],
        max_beam_width=2,
        release_out_of_window=release,
    )
    content = [{} for _ in m.pools]  # pool -> {(block, offset): token}
    tokens = {}  # request -> its token list (prompt, then generated)
    bases = [list(rng.integers(0, 50, 12)) for _ in range(3)]
    next_id = 0
    num_hits = 0

    def slot_of(rid, p, pos):
        return (m.get_block_ids(rid, p)[pos // bs], pos % bs)

    for _ in range(400):
        op = rng.choice(["add", "commit", "extend", "reserve", "rewind", "release", "free"])
        active = list(tokens)
        if op == "add" or not active:
            base = bases[rng.integers(3)]
            prompt = base[: rng.integers(1, 13)] + list(rng.integers(0, 50, rng.integers(0, 6)))
            rid = next_id
            next_id += 1
            r = m.add_request(rid, prompt, beam_width=int(rng.integers(1, 3)))
            if r.ok:
                tokens[rid] = list(prompt)
                assert r.num_cached_tokens % bs == 0 and r.num_cached_tokens < len(prompt)
                num_hits += r.num_cached_tokens > 0
                for pos in range(r.num_cached_tokens):
                    for p in range(2):
                        assert content[p][slot_of(rid, p, pos)] == prompt[pos]
            else:
                assert r.reason == "blocks" and not m.has_request(rid)
            continue
        rid = active[rng.integers(len(active))]
        n_tok, n_com = m.num_tokens(rid), m.num_committed_tokens(rid)
        if op == "commit" and n_tok > n_com:
            k = int(rng.integers(1, n_tok - n_com + 1))
            while len(tokens[rid]) < n_com + k:
                tokens[rid].append(int(rng.integers(0, 50)))
            for pos in range(n_com, n_com + k):
                for p in range(2):
                    content[p][slot_of(rid, p, pos)] = tokens[rid][pos]
            m.commit_tokens(rid, tokens[rid][n_com : n_com + k])
        elif op == "extend":
            n = int(rng.integers(0, 6))
            if n_tok + n <= m.max_seq_len:
                r = m.extend(rid, n)
                assert m.num_tokens(rid) == n_tok + n * r.ok
        elif op == "reserve":
            n = int(rng.integers(0, 6))
            if n_tok + n <= m.max_seq_len:
                m.reserve(rid, n)
                assert m.num_tokens(rid) == n_tok
        elif op == "rewind" and n_tok > n_com:
            m.rewind(rid, int(rng.integers(0, n_tok - n_com + 1)))
            del tokens[rid][max(m.num_tokens(rid), len(m.requests.get(rid).prompt)) :]
        elif op == "release":
            m.release_reserved(rid)
        elif op == "free":
            m.free(rid)
            del tokens[rid]
        check_invariants(m)
        for other in tokens:  # written tokens of active requests are intact
            committed = m.num_committed_tokens(other)
            for pos in range(committed):
                for p in range(2):
                    if p == 1 and release and pos < committed - 8 + 1:
                        continue  # out of the window: may be released
                    assert content[p][slot_of(other, p, pos)] == tokens[other][pos]
    assert num_hits > 0  # the run exercised prefix reuse


def test_batch_beam_selection_errors():
    m = make(max_beam_width=2)
    m.add_request("a", [1, 2, 3], beam_width=2)
    assert m.get_block_ids_per_seq(["a", "a"], beams=[1, 0])[:, 0].tolist() == [2, 1]
    with pytest.raises(ValueError, match="beam 2 outside"):
        m.get_block_ids_per_seq(["a"], beams=[2])
    with pytest.raises(ValueError, match="beam -1 outside"):
        m.get_batch_cache_indices_flat(["a"], beams=[-1])
    with pytest.raises(ValueError, match="beams has 1 entries"):
        m.get_batch_cache_indices(["a", "a"], beams=[0])
    with pytest.raises(ValueError, match="unknown request id"):
        m.get_batch_cache_indices([["unhashable"]])


def test_release_out_of_window_frees_dead_window_blocks():
    m = KVCacheManager(
        [32, 32],
        4,
        max_blocks_per_seq=8,
        window_sizes=(None, 6),
        layer_to_pool=[0, 1],
        release_out_of_window=True,
        max_beam_width=2,
    )
    prompt = list(range(13))
    m.add_request("a", prompt, beam_width=2)  # 3 shared full blocks + a tail per beam
    assert m.get_block_ids("a", pool=1, beam=0) == [1, 2, 3, 4]
    m.commit_tokens("a", prompt[:8])  # queries from 8 on see keys >= 3: block 0 still live
    assert m.get_block_ids("a", pool=1, beam=0) == [1, 2, 3, 4]
    m.commit_tokens("a", prompt[8:9])  # from 9 on: keys >= 4, block 0 (positions 0-3) dead
    assert m.get_block_ids("a", pool=1, beam=0) == [0, 2, 3, 4]
    assert m.get_block_ids("a", pool=1, beam=1) == [0, 2, 3, 5]
    assert m.pools[1].ref_count(1) == 0 and m.pools[1].is_free(1)
    assert m.get_block_ids("a", pool=0) == [1, 2, 3, 4]  # full attention keeps everything
    assert m.num_allocated_blocks("a") == 4
    m.commit_tokens("a", prompt[9:])  # c = 13: keys >= 8 -> blocks 0, 1 dead
    assert m.get_block_ids("a", pool=1, beam=1) == [0, 0, 3, 5]
    flat = m.get_batch_cache_indices_flat(["a"], layer_idx=1)
    assert flat.tolist() == [0, 0, 3, 4]
    check_invariants(m)
    m.free("a")  # holes are skipped
    assert m.num_free_blocks(0) == m.num_free_blocks(1) == 31
    # the released blocks kept their hashes: a new request reuses the whole chain
    assert m.add_request("b", prompt).num_cached_tokens == 12


def test_constructor_checks():
    with pytest.raises(ValueError, match="overflows int32"):
        KVCacheManager(2**26, 64, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="num_blocks has 1 entries for 2 pools"):
        KVCacheManager([8], 4, max_blocks_per_seq=4, window_sizes=(None, 4), layer_to_pool=[0])
    with pytest.raises(ValueError, match="layer_to_pool\\[1\\] = 2"):
        KVCacheManager(8, 4, max_blocks_per_seq=4, window_sizes=(None, 4), layer_to_pool=[0, 2])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="window_sizes entries"):
        KVCacheManager(8, 4, max_blocks_per_seq=4, window_sizes=(0,))


class _EndsAt:
    """A `PrefixState` that lets hits end only at the listed block hashes and records what
    the manager tells it."""

    def __init__(self) -> None:
        self.ends: set[bytes] = set()
        self.hashed: list[tuple] = []
        self.resets = 0

    def can_end(self, block_hash):
        return block_hash in self.ends

    def blocks_hashed(self, request_id, first_block, hashes):
        self.hashed.append((request_id, first_block, list(hashes)))

    def reset(self):
        self.resets += 1


def test_prefix_state_decides_where_a_hit_may_end():
    m = KVCacheManager(16, 4, max_blocks_per_seq=8)
    state = _EndsAt()
    m.prefix_cache.state = state
    prompt = list(range(14))  # 3 full blocks, 2 tokens in the tail
    m.add_request("a", prompt)
    m.commit_tokens("a", prompt[:6])  # block 0 filled
    m.commit_tokens("a", prompt[6:])  # block 1 (through the tail), then block 2
    hashes = m.requests.get("a").hashes
    assert state.hashed == [("a", b, [hashes[b]]) for b in range(3)]
    blocks = m.get_block_ids("a")
    m.free("a")
    got = m.add_request("b", prompt)
    assert (got.num_cached_tokens, got.num_shared_tokens) == (0, 12)  # no block may end a hit
    m.free("b")
    state.ends = {hashes[1]}
    got = m.add_request("c", prompt[:10] + [99] * 6)  # 2 blocks shared, both usable
    assert (got.num_cached_tokens, got.num_shared_tokens) == (8, 8)
    m.free("c")
    got = m.add_request("c", prompt)  # 3 blocks cached, 2 usable
    assert (got.num_cached_tokens, got.num_shared_tokens) == (8, 12)
    m.free("c")
    state.ends = {hashes[0], hashes[2]}
    assert m.add_request("d", prompt + [99]).num_cached_tokens == 12
    assert m.get_block_ids("d")[:3] == blocks[:3]
    m.reset_prefix_cache()
    assert state.resets == 1


def test_pending_blocks_are_the_uncommitted_prompt_blocks_of_admitted_requests():
    """``add_request(wait_for_pending=True)`` answers "pending_prefix" (allocating nothing)
    while the blocks after a prompt's cached run are still to be committed by an admitted
    request; commits and frees take blocks out of ``pending``; the chain hashed at admission
    is the one a commit would compute."""
    from kvplan.cache.block_pool import hash_prompt_blocks

    m = KVCacheManager(32, 4, max_blocks_per_seq=8)
    system = list(range(50, 62))  # 3 full blocks
    a, b = system + [1, 2, 3], system + [7, 8, 9, 10, 11]
    assert m.add_request("a", a).num_cached_tokens == 0
    chain = hash_prompt_blocks(a, 4, 3)
    assert m.prefix_cache.pending == {h: ["a"] for h in chain}
    free = m.num_free_blocks()
    got = m.add_request("b", b, wait_for_pending=True)
    assert (got.ok, got.reason, got.num_shared_tokens, got.pending_owner) == (
        False, "pending_prefix", 12, "a")  # fmt: skip
    assert not m.has_request("b") and m.num_free_blocks() == free
    assert m.add_request("c", list(range(12)), wait_for_pending=True).ok  # nothing shared
    m.commit_tokens("a", a[:5])  # block 0 cached, blocks 1 and 2 still pending
    assert [h for h, owners in m.prefix_cache.pending.items() if owners == ["a"]] == chain[1:]
    got = m.add_request("b", b, wait_for_pending=True)
    assert (got.reason, got.num_shared_tokens) == ("pending_prefix", 12)
    m.commit_tokens("a", a[5:])
    assert m.prefix_cache.pending == {h: ["c"] for h in hash_prompt_blocks(range(12), 4, 3)}
    assert m.requests.get("a").hashes == chain  # what committing would have hashed
    got = m.add_request("b", b, wait_for_pending=True)
    assert got.ok and got.num_cached_tokens == 12
    # two requests computing the same blocks (one did not wait); freeing one keeps the other's
    m.add_request("d", [5] * 9)
    m.add_request("e", [5] * 9)
    h = hash_prompt_blocks([5] * 9, 4, 2)
    assert [m.prefix_cache.pending[x] for x in h] == [["d", "e"], ["d", "e"]]
    m.free("d")
    assert [m.prefix_cache.pending[x] for x in h] == [["e"], ["e"]]
    got = m.add_request("f", [5] * 10, wait_for_pending=True)
    assert (got.reason, got.pending_owner) == ("pending_prefix", "e")
    m.free("e")
    assert m.add_request("f", [5] * 10, wait_for_pending=True).num_cached_tokens == 0
    for rid in ("b", "c", "f"):
        m.free(rid)
    assert m.prefix_cache.pending == {}
    # without prefix caching nothing is pending and nothing waits
    off = KVCacheManager(32, 4, max_blocks_per_seq=8, enable_prefix_caching=False)
    off.add_request("a", a)
    assert off.prefix_cache.pending == {} and off.add_request("b", b, wait_for_pending=True).ok
