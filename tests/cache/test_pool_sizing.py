"""Pool sizing (kvplan.cache.pool_sizing): the window bound against a brute-force walk of the
allocator's rule, the budget split as documented, and the errors."""

import random

import pytest

from kvplan._math import cdiv
from kvplan.cache import KVCacheManager
from kvplan.cache.pool_sizing import max_seqs_that_fit, plan_pool_blocks, window_blocks_per_seq


@pytest.mark.parametrize("window", [1, 3, 4, 12, 17])
@pytest.mark.parametrize("ahead", [1, 2, 5, 8])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_window_bound_is_the_most_any_commit_point_and_chunk_hold(window, ahead, bs):
    """Columns [max(0, c - W + 1) // bs, cdiv(e, bs)) over every commit point c and chunk end
    e in (c, c + ahead]: the maximum equals the formula (it is tight)."""
    most = 0
    for c in range(0, 4 * (window + ahead + bs)):
        lo = max(0, c - window + 1) // bs
        for e in range(c + 1, c + ahead + 1):
            most = max(most, cdiv(e, bs) - lo)
    assert window_blocks_per_seq(window, bs, ahead, 10_000) == most
    assert window_blocks_per_seq(window, bs, ahead, 2) == min(2, most)


def test_window_bound_holds_for_the_manager_rows():
    """Random chunked prefills and decodes through the manager (lazy window pool, release on
    commit): a row never holds more live window blocks than the bound."""
    rng = random.Random(0)
    bs, window, budget = 4, 10, 7
    bound = window_blocks_per_seq(window, bs, budget, 64)
    m = KVCacheManager.from_layer_windows(
        400, bs, [window, None], max_blocks_per_seq=64, release_out_of_window=True
    )
    for rid in range(12):
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 60))]  # repeats: prefix hits
        first = rng.randint(1, budget)
        assert m.add_request(rid, prompt, max_new_tokens=first).ok
        done = m.num_committed_tokens(rid)
        while done < len(prompt):
            end = min(len(prompt), done + rng.randint(1, budget))
            assert m.prepare_chunk(rid, end).ok
            assert sum(b != 0 for b in m.get_block_ids(rid, 0)) <= bound
            m.commit_tokens(rid, prompt[done:end])
            done = end
        for _ in range(rng.randint(0, 30)):
            assert m.extend(rid, 1).ok
            assert sum(b != 0 for b in m.get_block_ids(rid, 0)) <= bound
            m.commit_tokens(rid, [rng.randrange(5)])
        if rng.random() < 0.5:
            m.free(rid)


# window pool 0 (window 12) with 2 layers, full pool 1 with 1 layer; 100 bytes per layer block
WINDOWS, BYTES = (12, None), (200, 100)
GEOM = dict(block_size=4, max_blocks_per_seq=32, max_num_batched_tokens=8)


def test_memory_split_gives_the_full_pool_the_rest():
    need_w = window_blocks_per_seq(12, 4, 8, 32)  # cdiv(22, 4) = 6
    assert need_w == 6
    memory = 1_000_000
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=16, memory=memory, **GEOM)
    assert sizes.blocks_per_seq == (6, 32) and sizes.num_window_seqs == 16
    assert sizes.num_blocks[0] == 16 * 6 + 1
    assert sizes.num_blocks[1] == 16 * 32 + 1  # capped: max_num_seqs full-length sequences
    # a budget that binds: the window pool is sized for the sequences that fit everywhere
    memory = 20_000
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=16, memory=memory, **GEOM)
    n = max_seqs_that_fit(memory, (6, 32), BYTES)
    assert n == (20_000 - 300) // (6 * 200 + 32 * 100) == 4
    assert sizes.num_window_seqs == 4 and sizes.num_blocks[0] == 4 * 6 + 1
    assert sizes.num_blocks[1] == (memory - 25 * 200) // 100 == 150  # the rest, > 4 * 32 + 1
    assert sizes.total_bytes <= memory


def test_full_pages_for_every_layer_fit_fewer_sequences():
    memory = 20_000
    windowed = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=64, memory=memory, **GEOM)
    paged = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=64, memory=memory, windowed=False,
                             **GEOM)  # fmt: skip
    assert paged.blocks_per_seq == (32, 32) and paged.num_blocks[0] == paged.num_blocks[1]
    assert paged.num_blocks[0] == memory // 300
    assert (paged.num_blocks[1] - 1) // 32 == 2 < windowed.num_window_seqs == 4


def test_explicit_num_blocks_and_window_pool_seqs():
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=16, num_blocks=50, **GEOM)
    assert sizes.num_blocks == (50, 50)  # 16 * 6 + 1 > 50: at most num_blocks
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=16, num_blocks=50, window_pool_seqs=3,
                             **GEOM)  # fmt: skip
    assert sizes.num_blocks == (19, 50) and sizes.num_window_seqs == 3
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=16, memory=10**6, window_pool_seqs=2,
                             **GEOM)  # fmt: skip
    assert sizes.num_blocks == (16 + 1, 16 * 32 + 1)  # max_num_seqs one-block rows fit
    only = plan_pool_blocks((12,), (200,), max_num_seqs=5, memory=10**6, **GEOM)
    assert only.num_blocks == (31,) and only.num_window_seqs == 5


def test_budget_too_small_names_it():
    with pytest.raises(ValueError, match=r"kv_cache_memory=3000 bytes cannot hold one sequence"):
        plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=4, memory=3000, **GEOM)
    with pytest.raises(ValueError, match=r"num_blocks=20 cannot hold one sequence .* pool 1"):
        plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=4, num_blocks=20, **GEOM)
    with pytest.raises(ValueError, match=r"num_blocks=6 .* pool 0 \(window 12\)"):
        plan_pool_blocks((12,), (200,), max_num_seqs=4, num_blocks=6, **GEOM)
    with pytest.raises(ValueError, match="exactly one of memory and num_blocks"):
        plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=4, **GEOM)
    with pytest.raises(ValueError, match="window_pool_seqs must be an int >= 1"):
        plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=4, num_blocks=99, window_pool_seqs=0,
                         **GEOM)  # fmt: skip
    with pytest.raises(ValueError, match="block_bytes has 1 entries for 2 pools"):
        plan_pool_blocks(WINDOWS, (1,), max_num_seqs=4, num_blocks=99, **GEOM)


def test_capture_floor_never_takes_the_full_pool_memory():
    """The window pools' ``max_num_seqs + 1`` floor applies only when the budget still holds
    the planned sequences in the full pool."""
    sizes = plan_pool_blocks(WINDOWS, BYTES, max_num_seqs=1000, memory=20_000, **GEOM)
    assert sizes.num_window_seqs == 4 and sizes.num_blocks == (25, 150)


def test_kv_memory_bench_figures():
    """bench/kv_memory.py on Gemma-3-270M's shapes (bf16, 16-token blocks, 8K context,
    512-token chunks, 8 GiB), against hand arithmetic."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "bench" / "kv_memory.py"
    spec = importlib.util.spec_from_file_location("kv_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    memory = 8 << 30
    row = bench.report(bench.gemma3_270m_config(), context=8192, block_size=16,
                       kv_format="bf16", chunk=512, memory=memory)  # fmt: skip
    lb = 2 * 16 * 1 * 256 * 2  # K and V, 16 tokens, 1 KV head x 256, bf16
    assert row["layer_block_bytes"] == lb
    window_blocks = cdiv(512 + 512 + 16 - 2, 16)  # 65
    req = row["per_request"]
    assert req["full_pages_bytes"] == 18 * 512 * lb == 150_994_944
    assert req["window_pools_bytes"] == (15 * window_blocks + 3 * 512) * lb == 41_140_224
    assert req["window_pools_decoding_bytes"] == (15 * 33 + 3 * 512) * lb
    padding = 18 * lb
    assert (
        row["max_batch"]
        == {
            "full_pages": (memory - padding) // (18 * 512 * lb),
            "window_pools": (memory - padding) // ((15 * window_blocks + 3 * 512) * lb),
        }
        == {"full_pages": 56, "window_pools": 208}
    )
    assert row["engine_split"]["num_window_seqs"] == 208
    assert row["engine_split"]["total_bytes"] <= memory
