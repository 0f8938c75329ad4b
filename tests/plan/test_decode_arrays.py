"""The struct-of-arrays decode input: same metadata as the SequenceMetadata list and as the
eager ``prepare_decode``; vectorized validation naming the field and index before writing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_cases import random_config
from plan_cases import random_decode_batch as plan_cases_decode_batch
from test_decode_device import (
    TRITON_DEVICE,
    add_engram_ids,
    assert_same_decode,
    make_config,
    random_decode_batch,
)

from kvplan.plan.decode import prepare_decode
from kvplan.plan.decode_arrays import DecodeBatchArrays
from kvplan.plan.decode_device import make_decode_device_out, prepare_decode_on_device


def _manual_arrays(seqs, cfg, *, keep_spares: bool) -> DecodeBatchArrays:
    """Independent construction (plain Python loops), optionally keeping spare table entries."""
    tables = [
        list(s.block_table)
        if keep_spares
        else list(s.block_table[: cfg.num_blocks_for(s.seqlen_k)])
        for s in seqs
    ]
    offsets = np.cumsum([0] + [len(t) for t in tables])
    ids = [t for s in seqs for t in [s.token_ids[-1], *s.draft_tokens]]
    return DecodeBatchArrays(
        seqlen_q=np.array([s.seqlen_q for s in seqs], dtype=np.int32),
        seqlen_k=np.array([s.seqlen_k for s in seqs], dtype=np.int64),
        state_id=np.array([s.state_id for s in seqs], dtype=np.int32),
        is_placeholder=np.array([s.is_placeholder for s in seqs], dtype=bool),
        swa_valid_start=np.array([s.swa_valid_start for s in seqs], dtype=np.int64),
        block_table_flat=np.array([b for t in tables for b in t], dtype=np.int64),
        block_table_offsets=offsets.astype(np.int32),
        input_ids_flat=np.array(ids, dtype=np.int64),
    )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_both_input_forms_equal_eager_on_random_configs(seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    seqs = plan_cases_decode_batch(rng, cfg)
    want = prepare_decode(seqs, cfg)
    arrays = DecodeBatchArrays.from_sequences(seqs, cfg)
    assert_same_decode(prepare_decode_on_device(arrays, cfg, backend="torch"), want, cfg)
    assert_same_decode(prepare_decode_on_device(seqs, cfg, backend="torch"), want, cfg)
    if cfg.max_ngram_size == 0:  # the hand-built arrays carry no n-grams
        manual = _manual_arrays(seqs, cfg, keep_spares=bool(seed % 2))
        assert_same_decode(prepare_decode_on_device(manual, cfg, backend="torch"), want, cfg)


@pytest.mark.parametrize("seed", [3, 4])
def test_arrays_through_the_triton_kernels(seed):
    rng = np.random.default_rng(seed)
    cfg = make_config(device=TRITON_DEVICE)
    seqs = random_decode_batch(rng, cfg, 3)
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=12, max_seqlen_q=3)
    arrays = _manual_arrays(seqs, cfg, keep_spares=True)
    got = prepare_decode_on_device(arrays, cfg, out=out, backend="triton")
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)


def test_from_sequences_raises_like_prepare_decode():
    cfg = make_config()
    seqs = random_decode_batch(np.random.default_rng(1), cfg, 3)
    seqs[1].state_id = 99
    with pytest.raises(ValueError) as want:
        prepare_decode(seqs, cfg)
    with pytest.raises(ValueError) as got:
        DecodeBatchArrays.from_sequences(seqs, cfg)
    assert str(got.value) == str(want.value)


def _good(cfg):
    seqs = random_decode_batch(np.random.default_rng(7), cfg, 4)
    for s in seqs:  # a valid start > 0 somewhere, for the valid-start cases
        s.swa_valid_start = min(3, s.seqlen_k - s.seqlen_q)
    return _manual_arrays(seqs, cfg, keep_spares=True)


def _with(a: DecodeBatchArrays, name: str, i: int, value) -> DecodeBatchArrays:
    arr = getattr(a, name).copy()
    arr[i] = value
    return dataclasses.replace(a, **{name: arr})


@pytest.mark.parametrize(
    ("name", "i", "value", "match"),
    [
        ("seqlen_q", 2, 0, r"seqlen_q\[2\] = 0"),
        ("seqlen_q", 1, 9, r"seqlen_q\[1\] = 9: window_size"),
        ("seqlen_k", 3, 600, r"seqlen_k\[3\] = 600: exceeds max_model_len"),
        ("seqlen_k", 0, 0, r"seqlen_k\[0\] = 0: must be >= seqlen_q\[0\]"),
        ("state_id", 1, -1, r"state_id\[1\] = -1"),
        ("state_id", 2, 16, r"state_id\[2\] = 16: out of range"),
        ("swa_valid_start", 3, -2, r"swa_valid_start\[3\] = -2"),
        ("swa_valid_start", 0, 10**4, r"swa_valid_start\[0\] = 10000: must be <= q_start"),
        ("block_table_flat", 5, 64, r"block_table_flat\[5\] = 64: block id out of range"),
        ("block_table_flat", 0, -3, r"block_table_flat\[0\] = -3"),
        ("block_table_offsets", 0, 1, r"block_table_offsets\[0\] = 1"),
        ("input_ids_flat", 4, -1, r"input_ids_flat\[4\] = -1"),
    ],
)
def test_bad_arrays_raise_naming_field_and_index_before_writing(name, i, value, match):
    cfg = make_config()
    good = _good(cfg)
    out = make_decode_device_out(cfg, max_num_seqs=4, max_total_q=12, max_seqlen_q=3)
    before = out["decode_inputs"].clone()
    with pytest.raises(ValueError, match=match):
        prepare_decode_on_device(_with(good, name, i, value), cfg, out=out)
    assert torch.equal(out["decode_inputs"], before)
    prepare_decode_on_device(good, cfg, out=out)  # the unmodified batch is accepted


def test_short_table_row_and_bad_structure():
    cfg = make_config()
    good = _good(cfg)
    off = good.block_table_offsets.copy()
    off[1:] -= off[1] - off[0] - (cfg.num_blocks_for(int(good.seqlen_k[0])) - 1)  # row 0 short
    flat = good.block_table_flat[: int(off[-1])]
    short = dataclasses.replace(good, block_table_offsets=off, block_table_flat=flat)
    with pytest.raises(ValueError, match=r"block_table_offsets\[0:2\] = .*row 0 holds"):
        prepare_decode_on_device(short, cfg)
    dec = good.block_table_offsets.copy()
    dec[2] = dec[1] - 1
    with pytest.raises(ValueError, match=r"block_table_offsets\[2\] = .*must be >= "):
        prepare_decode_on_device(dataclasses.replace(good, block_table_offsets=dec), cfg)
    with pytest.raises(ValueError, match=r"block_table_offsets\[-1\]"):
        prepare_decode_on_device(dataclasses.replace(good, block_table_flat=flat[:-1]), cfg)
    with pytest.raises(ValueError, match="seqlen_k has 3 entries"):
        prepare_decode_on_device(dataclasses.replace(good, seqlen_k=good.seqlen_k[:3]), cfg)
    with pytest.raises(TypeError, match="state_id must have an integer dtype"):
        prepare_decode_on_device(dataclasses.replace(good, state_id=good.state_id * 1.0), cfg)
    with pytest.raises(TypeError, match="seqlen_q must be a numpy array"):
        prepare_decode_on_device(dataclasses.replace(good, seqlen_q=[1, 2, 3, 1]), cfg)
    with pytest.raises(ValueError, match="input_ids_flat has"):
        prepare_decode_on_device(dataclasses.replace(good, input_ids_flat=np.zeros(1, int)), cfg)
    with pytest.raises(ValueError, match="ngram_token_ids is required"):
        prepare_decode_on_device(good, make_config(max_ngram_size=2))


@pytest.mark.gpu
@pytest.mark.parametrize(("seed", "n_seq"), [(0, 1), (2, 256)])
def test_gpu_arrays_equal_eager(seed, n_seq):
    """CUDA counterpart of the random-config test (n-grams included: from_sequences)."""
    rng = np.random.default_rng(seed)
    cfg = make_config(device="cuda", max_ngram_size=2)
    seqs = random_decode_batch(rng, cfg, n_seq)
    add_engram_ids(seqs)
    got = prepare_decode_on_device(DecodeBatchArrays.from_sequences(seqs, cfg), cfg)
    torch.cuda.synchronize()
    assert got.positions.is_cuda
    assert_same_decode(got, prepare_decode(seqs, cfg), cfg)


@pytest.mark.gpu
def test_gpu_graph_replay_alternating_input_forms():
    """A graph captured at 8 sequences, replayed with list and array batches in turn (the
    pinned snapshot of each step is private, so back-to-back steps do not race)."""
    from kvplan.plan.decode_device import launch_decode_kernels, stage_decode_on_device

    rng = np.random.default_rng(9)
    cfg = make_config(device="cuda")
    out = make_decode_device_out(cfg, max_num_seqs=8, max_total_q=24, max_seqlen_q=3)
    big = stage_decode_on_device(random_decode_batch(rng, cfg, 8), cfg, out=out)
    launch_decode_kernels(big)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_decode_kernels(big)
    for step in range(4):
        seqs = random_decode_batch(rng, cfg, int(rng.integers(1, 9)))
        batch = _manual_arrays(seqs, cfg, keep_spares=True) if step % 2 else seqs
        staged = stage_decode_on_device(batch, cfg, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_decode(staged.meta, prepare_decode(seqs, cfg), cfg)


def test_module_docstring_example():
    """The layout example of decode_arrays: spare id 8 unread, rows expanded per query."""
    from kvplan.plan.config import MetadataConfig

    cfg = MetadataConfig(block_size=4, dense_ratios=(), sparse_ratios=(), window_size=2,
                         swa_block_size=4, max_model_len=16, max_num_blocks=4, num_kv_blocks=16)  # fmt: skip
    i32 = np.int32
    arrays = DecodeBatchArrays(
        seqlen_q=np.array([3, 1], i32), seqlen_k=np.array([10, 5], i32),
        state_id=np.array([0, 1], i32), is_placeholder=np.zeros(2, bool),
        swa_valid_start=np.zeros(2, i32), block_table_flat=np.array([7, 2, 9, 4, 1, 8], i32),
        block_table_offsets=np.array([0, 3, 6], i32),
        input_ids_flat=np.array([11, 12, 13, 21], i32),
    )  # fmt: skip
    meta = prepare_decode_on_device(arrays, cfg, backend="torch")
    assert meta.positions.tolist() == [7, 8, 9, 4]
    assert meta.input_ids.tolist() == [11, 12, 13, 21]
    assert meta.block_tables[:3, :3].tolist() == [[7, 2, 9]] * 3
    assert meta.block_tables[3, :2].tolist() == [4, 1]
