"""plan_compressor_state / expand_window_index equal the per-token reference, and a simulated
ring fed through them keeps every window's rows (chunks ending anywhere inside windows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplan.plan import SequenceMetadata
from kvplan.plan.compressor_state import (
    expand_window_index,
    plan_compressor_state,
    reference_compressor_state,
    state_rows,
)


def _batch(rng: np.random.Generator, n: int) -> list[SequenceMetadata]:
    seqs = []
    sids = rng.permutation(8)[:n]
    for i in range(n):
        q_start = int(rng.integers(0, 40))
        sq = int(rng.integers(1, 20))
        seqs.append(
            SequenceMetadata(
                seqlen_q=sq,
                seqlen_k=q_start + sq,
                block_table=[],
                state_id=int(sids[i]),
                token_ids=[0] * (q_start + sq),
                is_placeholder=bool(rng.random() < 0.1),
            )
        )
    return seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio,overlap", [(4, True), (4, False), (8, False), (2, True), (1, True)])
def test_plan_equals_reference(seed: int, ratio: int, overlap: bool) -> None:
    rng = np.random.default_rng(seed)
    seqs = _batch(rng, int(rng.integers(1, 5)))
    ring_rows = 8 * state_rows(ratio, overlap)
    plan = plan_compressor_state(seqs, ratio, overlap)
    ref = reference_compressor_state(seqs, ratio, overlap, ring_rows)
    assert np.array_equal(plan.slot_mapping_store_state, ref["slot_mapping_store_state"])
    assert np.array_equal(plan.entry_seq, ref["entry_seq"])
    assert np.array_equal(plan.entry_index, ref["entry_index"])
    assert np.array_equal(plan.positions, ref["entry_index"] * ratio)
    got = expand_window_index(torch.from_numpy(plan.window_facts), plan.state_rows, ring_rows)
    assert got.dtype == torch.int32
    assert np.array_equal(got.numpy(), ref["window_index"])


def test_docstring_example() -> None:
    s = SequenceMetadata(seqlen_q=6, seqlen_k=12, block_table=[], state_id=1, token_ids=[0] * 12)
    plan = plan_compressor_state([s], 4, True)
    assert plan.window_facts.tolist() == [[8, 0, 6, 0], [12, 0, 2, 0]]
    assert plan.slot_mapping_store_state.tolist() == [14, 15, 8, 9, 10, 11]


@pytest.mark.parametrize("ratio,overlap", [(4, True), (3, False), (4, False)])
def test_ring_simulation_keeps_every_window(ratio: int, overlap: bool) -> None:
    """Random chunk schedules of one request: each closing window, read through the ring
    (before the step's store) and the step rows, holds exactly its raw positions."""
    rng = np.random.default_rng(ratio * 10 + overlap)
    big_r = state_rows(ratio, overlap)
    for _ in range(20):
        sid, total = int(rng.integers(0, 3)), int(rng.integers(1, 60))
        ring = np.full(3 * big_r, -7, dtype=np.int64)  # a fresh request sees stale garbage
        q_start = 0
        while q_start < total:
            sq = int(min(rng.integers(1, 12), total - q_start))
            s = SequenceMetadata(sq, q_start + sq, [], sid, [0] * (q_start + sq))
            plan = plan_compressor_state([s], ratio, overlap)
            idx = expand_window_index(torch.from_numpy(plan.window_facts), big_r, len(ring))
            step = np.arange(q_start, q_start + sq)
            src = np.concatenate([ring, step])
            for e, j in enumerate(plan.entry_index):
                row = idx[e].numpy()
                got = [int(src[x]) if x >= 0 else None for x in row]
                want = [
                    x if x >= 0 else None for x in range((j + 1) * ratio - big_r, (j + 1) * ratio)
                ]
                assert got == want, (q_start, sq, j)
            keep = plan.slot_mapping_store_state >= 0
            ring[plan.slot_mapping_store_state[keep]] = step[keep]
            q_start += sq


def test_bad_input() -> None:
    s = SequenceMetadata(seqlen_q=0, seqlen_k=3, block_table=[], state_id=0, token_ids=[0] * 3)
    with pytest.raises(ValueError, match="seqlen_q = 0"):
        plan_compressor_state([s], 4, False)
    ok = SequenceMetadata(seqlen_q=1, seqlen_k=3, block_table=[], state_id=0, token_ids=[0] * 3)
    with pytest.raises(ValueError, match="ratio"):
        plan_compressor_state([ok], 0, False)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (4, False), (128, False), (8, True)])
def test_expand_window_index_kernel_equals_torch(ratio: int, overlap: bool) -> None:
    """The Triton expansion (CPU interpreter) equals the torch ops, int32 and int64, on a
    planned batch and on facts read through a transposed view (the static decode step's)."""
    from kvplan.plan.compressor_state import expand_window_index_torch, expand_window_index_triton

    rng = np.random.default_rng(ratio + overlap)
    seqs = _batch(rng, 5)
    big_r = state_rows(ratio, overlap)
    ring_rows = 8 * big_r
    facts = torch.from_numpy(plan_compressor_state(seqs, ratio, overlap).window_facts)
    want = expand_window_index_torch(facts, big_r, ring_rows)
    for dtype in (torch.int32, torch.int64):
        got = expand_window_index_triton(facts, big_r, ring_rows, dtype)
        assert got.dtype == dtype and torch.equal(got.int(), want)
    # int64 facts, one column per entry (strides (1, E)), as StaticDecodeStep reads them
    cols = torch.zeros(6, facts.shape[0], dtype=torch.int64)
    cols[1:5] = facts.t().long()
    view = cols[1:5].t()
    assert torch.equal(expand_window_index_triton(view, big_r, ring_rows), want)
    assert expand_window_index_triton(facts[:0], big_r, ring_rows).shape == (0, big_r)


def test_expand_window_index_checks() -> None:
    from kvplan.plan.compressor_state import expand_window_index_triton

    facts = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        expand_window_index(facts, 8, 64, torch.float32)
    with pytest.raises(ValueError, match=r"\[E, 4\]"):
        expand_window_index_triton(facts[:, :3], 8, 64)
    with pytest.raises(TypeError, match="window_facts"):
        expand_window_index_triton(facts.float(), 8, 64)
