"""The fast host staging of static hybrid decode steps (`kvplan.backends.hybrid.static_facts`).

Oracles: the exact path (``SequenceMetadata`` through the planning layer's checks, forced by
making the fast builder decline) for the staged bytes and the errors, and the general
``plan_compressor_state`` for the decode-only compressor-state plan.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvplan.backends.hybrid import static_step
from kvplan.backends.hybrid.api import HybridLayerSpec, HybridSeq
from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.plan.compressor_state import plan_compressor_state, plan_decode_compressor_state
from kvplan.plan.sequence import SequenceMetadata

MAX_LEN, BLOCK, SLOTS, ROWS = 512, 16, 6, 8
NUM_BLOCKS = SLOTS * (MAX_LEN // BLOCK) + 1


def _family() -> PlannedHybridFamily:
    def spec(kind, ratio):
        csa = kind == "compressed_sparse_attention"
        return HybridLayerSpec(kind, 8, ratio, 4 if csa else 0, 16, 8 if csa else 0, 2,
                               2 if csa else 0)  # fmt: skip

    specs = [spec("sliding_attention", 0), spec("compressed_sparse_attention", 4),
             spec("heavily_compressed_attention", 16)]  # fmt: skip
    return PlannedHybridFamily(specs, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                               num_state_slots=SLOTS, max_model_len=MAX_LEN)  # fmt: skip


def _staged(step: StaticDecodeStep) -> list[torch.Tensor]:
    """Every staged byte: the packed decode inputs and the model / compressor inputs."""
    return [step.buffers.out["decode_inputs"].clone(), step.buffers.inputs.clone()]


def _exact(monkeypatch, step: StaticDecodeStep, seqs) -> None:
    with monkeypatch.context() as m:
        m.setattr(static_step, "decode_rows", lambda *a: None)
        step.stage(seqs)


def _table(rng: random.Random, kind: str, ids: list[int]):
    return {"list": list, "tuple": tuple, "array": np.array}[kind](ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_staging_equals_exact_path(monkeypatch, seed):
    rng = random.Random(seed)
    fam = _family()
    fast = StaticDecodeStep(fam, ROWS, StaticDecodeBuffers(fam, ROWS))
    exact = StaticDecodeStep(fam, ROWS, StaticDecodeBuffers(fam, ROWS))
    perm = rng.sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)
    per = MAX_LEN // BLOCK
    tables = {s: perm[s * per : (s + 1) * per] for s in range(SLOTS)}
    tokens = [rng.randrange(1000) for _ in range(MAX_LEN)]
    pos = {s: rng.randrange(0, MAX_LEN - 40) for s in range(SLOTS)}
    for step_idx in range(30):
        slots = rng.sample(range(SLOTS), rng.randint(0, SLOTS))
        seqs = []
        for s in slots:
            pos[s] += 1
            if rng.random() < 0.1:  # another request takes the slot: a new table
                tables[s] = rng.sample(range(1, NUM_BLOCKS), per)
            keep = -(-(pos[s] + 1) // BLOCK) + rng.randint(0, 2)  # spare entries at times
            table = _table(rng, rng.choice(["list", "list", "tuple", "array"]), tables[s][:keep])
            seqs.append(HybridSeq(s, pos[s], 1, tokens[: pos[s] + 1], table, s))
        fast.stage(seqs)
        _exact(monkeypatch, exact, seqs)
        for a, b in zip(_staged(fast), _staged(exact)):
            assert torch.equal(a, b), f"step {step_idx}"


def test_cache_picks_up_changed_tables():
    fam = _family()
    buffers = StaticDecodeBuffers(fam, 2)
    step = StaticDecodeStep(fam, 2, buffers)
    bt_sec = buffers.out["_bound"].offsets["bt"][0] if "_bound" in buffers.out else None

    def staged_ids(seqs) -> list[int]:
        step.stage(seqs)
        off = buffers.out["_bound"].offsets["bt"][0]
        nb = sum(fam.config.num_blocks_for(s.q_start + 1) for s in seqs)
        return buffers.out["decode_inputs"][off : off + nb].tolist()

    assert bt_sec is None
    table = [5, 6, 7]
    seq = HybridSeq(0, 40, 1, [0] * 41, table, 0)  # 41 keys: 3 blocks of 16
    assert staged_ids([seq]) == [5, 6, 7]
    converted = buffers.tables.num_converted
    assert staged_ids([seq]) == [5, 6, 7]
    assert buffers.tables.num_converted == converted  # same table: no conversion
    table[1] = 9  # changed in place
    assert staged_ids([seq]) == [5, 9, 7]
    seq2 = HybridSeq(0, 41, 1, [0] * 42, [5, 9, 7, 8], 0)  # a new list, one more block
    assert staged_ids([seq2]) == [5, 9, 7]
    other = HybridSeq(3, 20, 1, [0] * 21, (11, 12), 0)  # another request in slot 0
    assert staged_ids([other]) == [11, 12]
    arr = np.array([1, 2, 3])
    third = HybridSeq(4, 40, 1, [0] * 41, arr, 1)
    assert staged_ids([other, third]) == [11, 12, 1, 2, 3]
    arr[0] = 4  # a numpy table is read each step
    assert staged_ids([other, third]) == [11, 12, 4, 2, 3]
    moved = HybridSeq(0, 40, 1, [0] * 41, table, 1)  # slot 1 now holds the list
    assert staged_ids([moved]) == [5, 9, 7]


@pytest.mark.parametrize(
    ("seq", "err", "match"),
    [
        (HybridSeq(0, 40, 1, [0] * 41, [1, 2, NUM_BLOCKS], 0), ValueError,
         rf"seqs\[0\].block_table = {NUM_BLOCKS}: block id out of range"),
        (HybridSeq(0, 40, 1, [0] * 41, [1, -2, 3], 0), ValueError,
         r"seqs\[0\].block_table = -2: block id out of range"),
        (HybridSeq(0, 40, 1, [0] * 41, [1, 2], 0), ValueError,
         r"seqs\[0\].block_table = '<2 blocks>': seqlen_k = 41 needs 3"),
        (HybridSeq(0, 40, 1, [0] * 41, [1.0, 2.0, 3.0], 0), TypeError, "integers"),
        (HybridSeq(0, 40, 1, [0] * 41, [1, 2, 3], SLOTS), ValueError,
         rf"seqs\[0\].state_id = {SLOTS}: out of range"),
        (HybridSeq(0, 40, 1, [0] * 41, [1, 2, 3], -1), ValueError, r"seqs\[0\].state_id = -1"),
        (HybridSeq(0, MAX_LEN, 1, [0] * (MAX_LEN + 1), list(range(1, 40)), 0), ValueError,
         rf"seqs\[0\].seqlen_k = {MAX_LEN + 1}: exceeds max_model_len"),
        (HybridSeq(0, 40, 1, [0] * 40, [1, 2, 3], 0), ValueError, r"seqs\[0\].token_ids has 40"),
        (HybridSeq(0, 40, 2, [0] * 42, [1, 2, 3], 0), ValueError, r"seqs\[0\].seqlen_q = 2"),
        (SequenceMetadata(1, 1, [0], 0, [0]), TypeError, r"seqs\[0\] must be a HybridSeq"),
    ],
)  # fmt: skip
def test_errors_name_the_field(monkeypatch, seq, err, match):
    fam = _family()
    for exact in (False, True):
        step = StaticDecodeStep(fam, 2, StaticDecodeBuffers(fam, 2))
        with pytest.raises(err, match=match):
            _exact(monkeypatch, step, [seq]) if exact else step.stage([seq])
        before = step.buffers.out["decode_inputs"].clone()
        assert not before.any()  # nothing written before the error


def test_spare_entries_are_not_checked():
    fam = _family()
    step = StaticDecodeStep(fam, 2, StaticDecodeBuffers(fam, 2))
    step.stage([HybridSeq(0, 40, 1, [0] * 41, [1, 2, 3, -5, NUM_BLOCKS], 0)])
    table = [1, 2, 3, NUM_BLOCKS]  # the bad id becomes used later: then it is caught
    step.stage([HybridSeq(0, 40, 1, [0] * 41, table, 0)])
    with pytest.raises(ValueError, match="block id out of range"):
        step.stage([HybridSeq(0, 60, 1, [0] * 61, table, 0)])  # 4 blocks


@pytest.mark.parametrize("seed", range(4))
def test_decode_compressor_plan_equals_general(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    qs = rng.integers(0, 300, n)
    sid = rng.permutation(64)[:n]
    ph = rng.random(n) < 0.2
    seqs = [SequenceMetadata(1, int(q) + 1, [0], int(s), [0] * (int(q) + 1), bool(p))
            for q, s, p in zip(qs, sid, ph)]  # fmt: skip
    for ratio, overlap in ((4, True), (4, False), (16, False), (1, True)):
        want = plan_compressor_state(seqs, ratio, overlap)
        got = plan_decode_compressor_state(qs, sid, ph, ratio, overlap)
        for name in ("slot_mapping_store_state", "entry_seq", "entry_index", "window_facts"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
