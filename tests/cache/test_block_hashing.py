"""Block hashes computed a run of blocks at a time (`iter_block_hashes`, `PrefixCache.commit`)
equal the one-block-at-a-time chain, whatever the chunking; ``commit_tokens(release=False)``
plus ``release_dead_blocks`` equals ``commit_tokens``; ``add_request`` keeps its own copy of
the prompt."""

import itertools

import numpy as np
import pytest
from test_kv_cache_batched import snapshot

from kvplan.cache import KVCacheManager, hash_block_tokens
from kvplan.cache.block_pool import hash_prompt_blocks, iter_block_hashes


def chain(tokens, bs, n, parent=None):
    out = []
    for b in range(n):
        parent = hash_block_tokens(parent, tokens[b * bs : (b + 1) * bs])
        out.append(parent)
    return out


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_iter_block_hashes_equals_the_chain(bs):
    rng = np.random.default_rng(bs)
    tokens = rng.integers(0, 1 << 40, 75 * bs + 3).tolist()  # > 2 runs of 32 blocks, a tail
    parent = hash_block_tokens(None, [7] * bs)
    assert hash_prompt_blocks(tokens, bs, 75) == chain(tokens, bs, 75)
    assert list(iter_block_hashes(tokens, bs, 75, parent)) == chain(tokens, bs, 75, parent)
    as_array = np.asarray(tokens, dtype=np.int64)
    assert list(iter_block_hashes(as_array, bs, 40)) == chain(tokens, bs, 40)
    first = list(itertools.islice(iter_block_hashes(tokens, bs, 75), 33))  # stopped early
    assert first == chain(tokens, bs, 33)
    assert list(iter_block_hashes(tokens, bs, 0)) == []


def per_token(m, rid, tokens):
    for t in tokens:
        m.commit_tokens(rid, [t])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beam_width", [1, 2])
def test_chunked_commits_equal_token_by_token(seed, beam_width):
    """Random chunk sizes (inside a block, across several, ending mid-block) leave the same
    hashes, caches, free lists and tails as committing one token at a time."""
    rng = np.random.default_rng(seed)
    bs = 4
    prompt = rng.integers(0, 50, 45).tolist()
    extra = rng.integers(0, 50, 10).tolist()
    managers = [
        KVCacheManager(64, bs, max_blocks_per_seq=16, max_beam_width=beam_width) for _ in range(2)
    ]
    for m in managers:
        assert m.add_request("a", prompt, beam_width=beam_width).ok
        assert m.extend("a", len(extra)).ok
    tokens = prompt + extra
    done = 0
    while done < len(tokens):
        n = int(rng.integers(1, 3 * bs + 2))
        managers[0].commit_tokens("a", tokens[done : done + n])
        done += n
    per_token(managers[1], "a", tokens)
    assert snapshot(managers[0]) == snapshot(managers[1])
    req = managers[0].requests.get("a")
    num_hashed = len(prompt) // bs if beam_width > 1 else len(tokens) // bs
    assert req.hashes == hash_prompt_blocks(tokens, bs, num_hashed)
    tail = managers[0].requests.tail[req.rows[0]]
    assert tail[: len(tokens) % bs].tolist() == tokens[len(tokens) - len(tokens) % bs :]


def test_release_later_equals_release_in_commit():
    def make():
        return KVCacheManager.from_layer_windows(
            [32, 32], 4, [8, None], max_blocks_per_seq=16, release_out_of_window=True
        )

    prompt = list(range(1, 41))
    a, b = make(), make()
    for m in (a, b):
        assert m.add_request("r", prompt).ok
    a.commit_tokens("r", prompt[:30])
    b.commit_tokens("r", prompt[:30], release=False)
    assert a.get_block_ids("r", 0)[:5] == [0] * 5  # released in the commit
    assert all(b.get_block_ids("r", 0)[:5])  # not yet
    b.release_dead_blocks("r")
    assert snapshot(a) == snapshot(b)


def test_add_request_copies_the_prompt():
    m = KVCacheManager(16, 4, max_blocks_per_seq=8)
    prompt = [1, 2, 3, 4, 5]
    assert m.add_request("a", prompt).ok
    prompt[0] = 9  # the caller's list changes, the request's prompt does not
    with pytest.raises(ValueError, match="differ from the prompt"):
        m.commit_tokens("a", prompt)
    m.commit_tokens("a", [1, 2, 3, 4, 5])
    assert m.num_committed_tokens("a") == 5
    m.add_request("b", np.array([7, 8, 9, 10, 11]))  # numpy ints: converted
    m.commit_tokens("b", np.array([7, 8, 9, 10]))
    assert m.requests.get("b").prompt == [7, 8, 9, 10, 11]
    assert type(m.requests.get("b").prompt[0]) is int
