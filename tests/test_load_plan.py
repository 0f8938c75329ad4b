"""BlockLoadPlanBuilder and validate_load_plan against a per-row expansion of the plan."""

import numpy as np
import pytest
import torch

from kvplan.load_plan import BlockLoadPlanBuilder, validate_load_plan


def expand_plan(segments: torch.Tensor, total_k: int) -> list:
    """Per output row: (src_block, src_offset), ("zero",) for zero fill, None if unwritten."""
    rows: list = [None] * total_k
    for src, begin, end, dst in segments.tolist():
        for i in range(end - begin):
            assert rows[dst + i] is None, "overlapping destinations"
            rows[dst + i] = ("zero",) if src == -1 else (src, begin + i)
    return rows


def test_docstring_example():
    b = BlockLoadPlanBuilder(4)
    b.append_zero_fill(2)
    b.append_paged_range([7, 2, 9], 3, 9)
    segments, total_k = b.build()
    assert segments.dtype == torch.int32
    assert segments.tolist() == [[-1, 0, 2, 0], [7, 3, 4, 2], [2, 0, 4, 3], [9, 0, 1, 7]]
    assert total_k == 8 == b.total_k
    assert b.num_segments == 4


def test_seed_walkthrough_compressed_and_ring():
    # Compressed KV: 2500 compressed tokens, 16 per block -> 157 segments, last one 4 tokens.
    table = list(range(1000, 1157))
    b = BlockLoadPlanBuilder(16)
    b.append_paged_range(table, 0, 2500)
    seg, total = b.build()
    assert total == 2500 and seg.shape == (157, 4)
    assert seg[-1].tolist() == [1156, 0, 4, 2496]
    assert seg[:, 3].tolist() == list(range(0, 2500, 16))
    # SWA ring of 4096: history [4880, 8976) wraps at 784.
    b = BlockLoadPlanBuilder(4096)
    b.append_zero_fill(0)
    b.append_ring_range(5, 4880, 8976)
    seg, total = b.build()
    assert seg.tolist() == [[5, 784, 4096, 0], [5, 0, 784, 3312]]
    assert total == 4096


@pytest.mark.parametrize("block_size", [1, 3, 4, 64, 133])
def test_paged_range_random(block_size):
    rng = np.random.default_rng(block_size)
    for _ in range(20):
        num_logical = int(rng.integers(1, 12))
        table = rng.permutation(50)[:num_logical]
        limit = num_logical * block_size
        begin, end = sorted(int(x) for x in rng.integers(0, limit + 1, size=2))
        b = BlockLoadPlanBuilder(block_size)
        b.append_zero_fill(int(rng.integers(0, 5)))
        head = b.total_k
        b.append_paged_range(torch.tensor(table, dtype=torch.int32), begin, end)
        seg, total = b.build()
        assert total == head + end - begin
        rows = expand_plan(seg, total)
        assert rows[:head] == [("zero",)] * head
        want = [(int(table[t // block_size]), t % block_size) for t in range(begin, end)]
        assert rows[head:] == want
        # one segment per block touched, never crossing a block boundary
        touched = len({t // block_size for t in range(begin, end)})
        assert b.num_segments - (seg[:, 0] == -1).sum().item() == touched
        assert ((seg[:, 2] - seg[:, 1]) > 0).all()
        validate_load_plan(seg, total, 50, block_size, require_full_cover=True)


@pytest.mark.parametrize("ring", [1, 5, 8, 133])
def test_ring_range_random(ring):
    rng = np.random.default_rng(ring)
    for _ in range(30):
        length = int(rng.integers(0, ring + 1))
        begin = int(rng.integers(0, 4 * ring))
        b = BlockLoadPlanBuilder(ring)
        b.append_ring_range(3, begin, begin + length)
        seg, total = b.build()
        assert total == length
        assert b.num_segments <= 2
        assert expand_plan(seg, total) == [(3, t % ring) for t in range(begin, begin + length)]
        validate_load_plan(seg, total, 4, ring, require_full_cover=True)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 8, 9, 24, 25])
def test_zero_fill_chunks(num_tokens):
    b = BlockLoadPlanBuilder(8)
    b.append_zero_fill(num_tokens)
    seg, total = b.build()
    assert total == num_tokens
    assert seg.shape[0] == (num_tokens + 7) // 8
    assert expand_plan(seg, total) == [("zero",)] * num_tokens
    assert (seg[:, 0] == -1).all() and (seg[:, 2] - seg[:, 1] <= 8).all()


def test_append_segment_and_rebuild():
    b = BlockLoadPlanBuilder(8)
    b.append_segment(4, 2, 6)
    b.append_segment(0, 3, 3)  # empty: nothing appended
    first, total1 = b.build()
    b.append_segment(-1, 0, 8)
    second, total2 = b.build(device="cpu")
    assert first.tolist() == [[4, 2, 6, 0]] and total1 == 4
    assert second.tolist() == [[4, 2, 6, 0], [-1, 0, 8, 4]] and total2 == 12
    empty, zero = BlockLoadPlanBuilder(8).build()
    assert empty.shape == (0, 4) and empty.dtype == torch.int32 and zero == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: b.append_segment(-2, 0, 1), "src_block"),
        (lambda b: b.append_segment(0, 3, 2), "src_begin"),
        (lambda b: b.append_segment(0, 0, 9), "source_block_size"),
        (lambda b: b.append_segment(2**31, 0, 1), "src_block"),
        (lambda b: b.append_zero_fill(-1), "num_tokens"),
        (lambda b: b.append_paged_range([0, 1], 5, 17), "block_table"),
        (lambda b: b.append_paged_range([0, -1], 5, 10), "block_table"),
        (lambda b: b.append_paged_range([0, 1], 6, 5), "begin"),
        (lambda b: b.append_ring_range(0, 3, 12), "ring"),
        (lambda b: b.append_ring_range(-1, 0, 1), "state_id"),
    ],
)
def test_rejected_calls_leave_builder_unchanged(call, match):
    b = BlockLoadPlanBuilder(8)
    b.append_segment(1, 0, 8)
    with pytest.raises(ValueError, match=match):
        call(b)
    seg, total = b.build()
    assert seg.tolist() == [[1, 0, 8, 0]] and total == 8


def test_type_errors():
    with pytest.raises(TypeError, match="source_block_size"):
        BlockLoadPlanBuilder(4.0)
    with pytest.raises(ValueError, match="source_block_size"):
        BlockLoadPlanBuilder(0)
    b = BlockLoadPlanBuilder(4)
    with pytest.raises(TypeError, match="begin"):
        b.append_paged_range([0], 0.5, 1)
    with pytest.raises(TypeError, match="block_table"):
        b.append_paged_range(torch.tensor([0.0]), 0, 1)
    with pytest.raises(ValueError, match="block_table"):
        b.append_paged_range([[0]], 0, 1)


def test_total_k_overflow():
    b = BlockLoadPlanBuilder(2**20)
    b.append_zero_fill(2**31 - 1)
    with pytest.raises(ValueError, match="total_k"):
        b.append_segment(-1, 0, 1)
    with pytest.raises(ValueError, match="total_k"):
        BlockLoadPlanBuilder(1).append_zero_fill(2**31)  # rejected before 2**31 segments
    assert b.total_k == 2**31 - 1


def plan(rows):
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)


@pytest.mark.parametrize(
    "rows, total_k, match",
    [
        ([[10, 0, 4, 0]], 4, r"load_segments\[0\].*src_block"),
        ([[0, 0, 4, 0], [-2, 0, 4, 4]], 8, r"load_segments\[1\].*src_block"),
        ([[0, 3, 2, 0]], 4, "src_begin"),
        ([[0, -1, 2, 0]], 4, "src_begin"),
        ([[0, 0, 9, 0]], 9, "block_size=8"),
        ([[0, 0, 4, 2]], 5, "total_k=5"),
        ([[0, 0, 4, -1]], 5, "total_k"),
        ([[0, 0, 4, 0], [1, 0, 4, 8], [2, 0, 2, 3]], 12, r"load_segments\[2\].*overlap"),
    ],
)
def test_validate_rejects(rows, total_k, match):
    with pytest.raises(ValueError, match=match):
        validate_load_plan(plan(rows), total_k, num_blocks=10, block_size=8)


def test_validate_accepts_gaps_and_empty_segments():
    # gap at rows [4, 6), an empty segment whose offset sits inside another one
    validate_load_plan(plan([[0, 0, 4, 0], [3, 2, 2, 1], [-1, 0, 2, 6]]), 8, 10, 8)
    with pytest.raises(ValueError, match="cover 6 rows"):
        validate_load_plan(plan([[0, 0, 4, 0], [-1, 0, 2, 6]]), 8, 10, 8, require_full_cover=True)
    validate_load_plan(plan([]), 0, 10, 8, require_full_cover=True)
    with pytest.raises(ValueError, match="empty"):
        validate_load_plan(plan([]), 3, 10, 8, require_full_cover=True)


def test_validate_types():
    with pytest.raises(TypeError, match="load_segments"):
        validate_load_plan(plan([[0, 0, 1, 0]]).long(), 1, 10, 8)
    with pytest.raises(ValueError, match="load_segments"):
        validate_load_plan(torch.zeros(2, 3, dtype=torch.int32), 1, 10, 8)
    with pytest.raises(TypeError, match="total_k"):
        validate_load_plan(plan([[0, 0, 1, 0]]), 1.0, 10, 8)
