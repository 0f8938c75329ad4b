"""The AttentionMetadata contract: capacity, per-step shape, derived counts, ledger checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import SeqSpec, fill_metadata, make_scenario

from kvplan.backends import (
    BACKEND_NAMES,
    AttentionMetadata,
    VanillaAttentionMetadata,
    get_backend,
)
from kvplan.backends.block_tables import (
    check_allocated,
    decode_last_blocks,
    decode_token_slots,
    flat_page_index,
    last_needed_blocks,
    logical_num_blocks,
    new_token_slots,
    table_rows,
)
from kvplan.backends.lengths import as_lengths
from kvplan.backends.staging import DeviceArena


def test_derived_counts_follow_every_setter():
    md = AttentionMetadata(max_num_requests=4, max_num_tokens=64)
    md.seq_lens = [5, 3, 1, 1]
    md.num_contexts = 2
    assert (md.num_seqs, md.num_generations, md.num_ctx_tokens, md.num_tokens) == (4, 2, 8, 10)
    md.seq_lens = torch.tensor([7, 1, 1], dtype=torch.int32)
    assert (md.num_seqs, md.num_generations, md.num_ctx_tokens, md.num_tokens) == (3, 1, 8, 9)
    md.num_contexts = 0
    assert (md.num_generations, md.num_ctx_tokens) == (3, 0)
    assert md.num_kv_tokens == 9


def test_seq_lens_device_copy_is_written_in_place():
    md = AttentionMetadata(max_num_requests=4, max_num_tokens=64, is_cuda_graph=True)
    md.seq_lens = [3, 1]
    ptr = md.seq_lens_gpu.data_ptr()
    md.seq_lens = [2, 5]
    assert md.seq_lens_gpu.data_ptr() == ptr
    assert md.seq_lens_cuda.tolist() == [2, 5]
    first = md.seq_lens
    md.seq_lens = [4, 4]
    assert first.tolist() == [2, 5], "each assignment gets a private host tensor"


def test_is_cross_is_object_identity():
    md = AttentionMetadata(max_num_requests=4, max_num_tokens=64)
    md.seq_lens = [3, 1]
    assert md.seq_lens_kv is md.seq_lens and not md.is_cross
    md.seq_lens_kv = [3, 1]  # equal values, different object: still cross
    assert md.is_cross and md.num_kv_tokens == 4
    md.seq_lens_kv = None
    assert not md.is_cross


@pytest.mark.parametrize(
    ("field", "value", "exc"),
    [
        ("seq_lens", [1, -2], ValueError),
        ("seq_lens", [1.5], TypeError),
        ("seq_lens", [[1, 2]], ValueError),
        ("seq_lens", [1] * 9, ValueError),
        ("num_contexts", -1, ValueError),
    ],
)
def test_setter_validation(field, value, exc):
    md = AttentionMetadata(max_num_requests=4, max_num_tokens=64, max_num_sequences=8)
    with pytest.raises(exc, match=field):
        setattr(md, field, value)


def test_capacity_validation():
    with pytest.raises(ValueError, match="max_num_tokens"):
        AttentionMetadata(max_num_requests=4, max_num_tokens=0)
    with pytest.raises(ValueError, match="max_num_sequences"):
        AttentionMetadata(max_num_requests=4, max_num_tokens=8, max_num_sequences=2)
    md = AttentionMetadata(max_num_requests=4, max_num_tokens=8)
    md.seq_lens = [5, 5]
    with pytest.raises(ValueError, match="max_num_tokens"):
        md.prepare()


def test_prepare_checks_the_ledger():
    sc = make_scenario(0, [SeqSpec(0, 5, True), SeqSpec(9, 1, False)])
    md = VanillaAttentionMetadata(
        max_num_requests=4, max_num_tokens=64, kv_cache_manager=sc.manager, kv_cache=sc.kv
    )
    fill_metadata(md, sc)
    md.request_ids = [0]
    with pytest.raises(ValueError, match="request_ids"):
        md.prepare()
    fill_metadata(md, sc)
    md.num_contexts = 3
    with pytest.raises(ValueError, match="num_contexts"):
        md.prepare()
    fill_metadata(md, sc)
    md.num_cached_tokens_per_seq = [0, 40]  # past the allocated blocks
    with pytest.raises(ValueError, match="blocks"):
        md.prepare()
    fill_metadata(md, sc)
    md.beam_width = 2
    with pytest.raises(ValueError, match="beam_width"):
        md.prepare()
    fill_metadata(md, sc)
    md.num_cached_tokens_per_seq = [0, 2**31 - 1]  # + 1 new token: past int32
    with pytest.raises(ValueError, match=r"num_cached_tokens_per_seq\[1\] .* overflows int32"):
        md.prepare()
    fill_metadata(md, sc)
    md.prepare()
    assert md.prepared
    md.seq_lens = sc.seq_lens
    assert not md.prepared, "a shape change invalidates prepare()"
    attn = get_backend("vanilla")(0, 4, 2, 16)
    with pytest.raises(ValueError, match="prepare"):
        attn.forward(sc.q, sc.k[0], sc.v[0], md)
    md.prepare()
    with pytest.raises(ValueError, match="q must have shape"):
        attn.forward(sc.q[1:], sc.k[0], sc.v[0], md)
    base_md = AttentionMetadata(max_num_requests=4, max_num_tokens=64)
    with pytest.raises(TypeError, match="VanillaAttentionMetadata"):
        attn.forward(sc.q, sc.k[0], sc.v[0], base_md)
    with pytest.raises(TypeError, match="RaggedAttentionMetadata"):
        get_backend("ragged")(0, 4, 2, 16).forward(sc.q, sc.k[0], sc.v[0], md)


def test_backend_ctor_validation_and_names():
    with pytest.raises(ValueError, match="multiple"):
        get_backend("vanilla")(0, 6, 4, 16)
    with pytest.raises(ValueError, match="sliding_window"):
        get_backend("vanilla")(0, 4, 2, 16, sliding_window=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("flash")
    for name in BACKEND_NAMES:
        assert get_backend(name).name == name
        assert get_backend(name).Metadata.__name__.endswith("AttentionMetadata")


@pytest.mark.parametrize("seed", range(6))
def test_new_token_slots_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 3, 4, 16]))
    n = int(rng.integers(1, 9))
    table = rng.integers(1, 50, size=(n, 40)).astype(np.int32)
    cached = rng.integers(0, 5 * bs, size=n).astype(np.int32)
    new = rng.integers(0, 3 * bs + 2, size=n).astype(np.int32)
    if seed % 2:
        new[:] = 1  # the decode path
    want = [
        int(table[b, p // bs]) * bs + p % bs
        for b in range(n)
        for p in range(cached[b], cached[b] + new[b])
    ]
    got = new_token_slots(table_rows(table), cached, new, bs)
    assert got.dtype == np.int32
    assert got.tolist() == want
    if seed % 2:  # decode: the last held block of each row names the same slots
        last = check_allocated(table, logical_num_blocks(cached + 1, bs))
        assert decode_token_slots(last, cached, bs).tolist() == want
    table[n - 1, :] = 0
    new[n - 1] = 1
    with pytest.raises(ValueError, match="unallocated"):
        new_token_slots(table_rows(table), cached, new, bs)
    new[n - 1] = 40 * bs + 1 - cached[n - 1]
    with pytest.raises(ValueError, match="past max_blocks_per_seq"):
        new_token_slots(table_rows(table), cached, new, bs)


def test_arena_stages_through_a_private_snapshot():
    arena = DeviceArena({"a": 4, "b": 8}, torch.device("cpu"), private_snapshots=True)
    ptr = arena.view("b").data_ptr()
    arena.stage({"a": np.array([1, 2], np.int32), "b": np.array([7, 8, 9], np.int32)})
    snap = arena.last_snapshot
    assert arena.view("a")[:2].tolist() == [1, 2] and arena.view("b")[:3].tolist() == [7, 8, 9]
    arena.stage({"a": np.array([5], np.int32)})
    assert snap.tolist()[:2] == [1, 2], "a later stage never writes an earlier snapshot"
    assert arena.view("b").data_ptr() == ptr
    with pytest.raises(ValueError, match="capacity"):
        arena.stage({"a": np.zeros(5, np.int32)})


def test_cpu_arena_writes_in_place_with_the_same_result():
    fields = {"a": 4, "b": 8}
    direct = DeviceArena(fields, torch.device("cpu"))
    snap = DeviceArena(fields, torch.device("cpu"), private_snapshots=True)
    assert not direct.private_snapshots and snap.private_snapshots
    ptr = direct.buffer.data_ptr()
    steps = [{"a": np.array([1, 2], np.int32), "b": np.arange(8, dtype=np.int32)},
             {"b": np.array([9], np.int32)}, {"a": np.array([3, 4, 5, 6], np.int32)}]  # fmt: skip
    for values in steps:
        direct.stage(values)
        snap.stage(values)
        for name, arr in values.items():
            assert direct.view(name)[: arr.size].tolist() == arr.tolist()
            assert snap.view(name)[: arr.size].tolist() == arr.tolist()
    assert direct.last_snapshot is None and direct.buffer.data_ptr() == ptr
    with pytest.raises(ValueError, match="capacity"):
        direct.stage({"b": np.zeros(9, np.int32)})


def test_cuda_graph_metadata_is_decode_only():
    md = get_backend("ragged").Metadata(max_num_requests=4, max_num_tokens=32, is_cuda_graph=True)
    md.num_contexts = 1
    md.seq_lens = [3]
    with pytest.raises(ValueError, match="CUDA-graph"):
        md.prepare()
    with pytest.raises(ValueError, match="CUDA"):
        VanillaAttentionMetadata(max_num_requests=4, max_num_tokens=32, is_cuda_graph=True)


@pytest.mark.parametrize("seed", range(4))
def test_as_lengths_against_numpy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    ints = rng.integers(0, 5 if seed % 2 else 2, size=n).tolist()
    forms = [ints, tuple(ints), np.array(ints, np.int32), np.array(ints, np.int64),
             torch.tensor(ints, dtype=torch.int32), [1] * n]  # fmt: skip
    for value in forms:
        want = np.asarray(value, dtype=np.int64)
        arr, total, all_ones = as_lengths("x", value)
        assert arr.dtype == np.int32 and arr.tolist() == want.tolist()
        assert total == int(want.sum())
        assert all_ones == (n > 0 and bool((want == 1).all()))
        if isinstance(value, np.ndarray):
            assert not np.shares_memory(arr, value), "a private copy"
    for bad, exc, msg in [([3, -1], ValueError, "-1"), ([1, 2**31], ValueError, "overflows"),
                          ([1, 1.0], TypeError, "integers"), ([1, 2**32, -(2**32)], ValueError, "-4294967296"),
                          (np.array([2, -3], np.int32), ValueError, "-3")]:  # fmt: skip
        with pytest.raises(exc, match=msg):
            as_lengths("x", bad)


def test_arena_begin_out_commit_stages_one_private_snapshot():
    arena = DeviceArena({"a": 4, "b": 8}, torch.device("cpu"), private_snapshots=True)
    host = arena.begin(arena.end_of("b", 3))
    arena.put(host, "a", np.array([1, 2], np.int32))
    np.add(np.arange(3, dtype=np.int32), 7, out=arena.out(host, "b", 3))
    assert arena.view("b")[:3].tolist() == [0, 0, 0], "nothing reaches the device before commit"
    arena.commit()
    snap = arena.last_snapshot
    assert arena.view("a")[:2].tolist() == [1, 2] and arena.view("b")[:3].tolist() == [7, 8, 9]
    host2 = arena.begin(arena.end_of("a", 1))
    assert not np.shares_memory(host, host2), "every step stages through a fresh snapshot"
    arena.put(host2, "a", np.array([5], np.int32))
    arena.commit()
    assert snap.tolist()[4:7] == [7, 8, 9] and arena.view("a")[:1].tolist() == [5]
    with pytest.raises(ValueError, match="capacity"):
        arena.out(arena.begin(12), "a", 5)
    with pytest.raises(ValueError, match="exceeds the arena"):
        arena.begin(13)


def test_flat_page_index_against_a_loop():
    rng = np.random.default_rng(0)
    width, n = 7, 9
    rows = rng.permutation(20)[:n].astype(np.int64)
    num_blocks = rng.integers(0, width + 1, size=n).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(num_blocks)]).astype(np.int32)
    got = flat_page_index(rows * width, indptr, num_blocks, np.arange(200, dtype=np.int64))
    want = [r * width + j for r, nb in zip(rows.tolist(), num_blocks.tolist()) for j in range(nb)]
    assert got.tolist() == want


def test_decode_last_blocks_checks_the_table():
    table = np.array([[4, 9, 0], [3, 0, 0]], np.int32)
    rows = table_rows(table)
    assert decode_last_blocks(rows, np.array([1, 0]), 1).tolist() == [9, 3]
    with pytest.raises(ValueError, match="sequence 1 needs 2 blocks .* holds fewer"):
        decode_last_blocks(rows, np.array([1, 1]), 1)
    with pytest.raises(ValueError, match="sequence 0 needs 4 blocks .* 3 columns"):
        decode_last_blocks(rows, np.array([3, 0]), 3)


@pytest.mark.parametrize("seed", range(6))
def test_last_needed_blocks_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    n, width = int(rng.integers(1, 9)), 6
    held = rng.integers(0, width + 1, size=n)  # blocks each row holds (filled from column 0)
    table = np.zeros((n, width), np.int32)
    for b in range(n):
        table[b, : held[b]] = rng.integers(1, 50, size=held[b])
    needed = np.minimum(held + rng.integers(-2, 2, size=n), width).clip(0).astype(np.int32)
    needed[rng.integers(0, n)] = 0  # a row without blocks (its column -1 is no block)
    bad = [b for b in range(n) if needed[b] > held[b]]
    rows = table_rows(table)
    if bad:
        with pytest.raises(ValueError, match=f"sequence {bad[0]} needs"):
            last_needed_blocks(rows, needed, check_only=True)
        return
    assert last_needed_blocks(rows, needed, check_only=True) is None
    assert last_needed_blocks(rows, needed) is None  # a row needs no block: no last blocks
    owners = np.flatnonzero(held > 0)  # rows holding blocks, each needing all of them
    if owners.size:
        got = last_needed_blocks(table_rows(table[owners]), held[owners].astype(np.int32))
        assert got.tolist() == [int(table[b, held[b] - 1]) for b in owners]


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_set_step_equals_the_setters(name):
    """set_step() sets one step's fields in one call, whatever the previous step's shape,
    and prepare() then builds what the setters would have built."""
    sc = make_scenario(11, [SeqSpec(7, 3, True), SeqSpec(9, 1, False), SeqSpec(5, 1, False)])
    kw = {"max_num_requests": 4, "max_num_tokens": 64, "kv_cache_manager": sc.manager}
    a, b = (get_backend(name).Metadata(kv_cache=sc.kv, **kw) for _ in range(2))
    fill_metadata(a, sc)
    a.prepare()
    b.seq_lens, b.num_contexts = [1], 1  # a previous step of another shape
    b.set_step(
        list(a.request_ids), a.prompt_lens, a.num_cached_tokens_per_seq,
        a.seq_lens.tolist(), a.num_contexts,
    )  # fmt: skip
    assert not b.prepared
    assert (b.num_seqs, b.num_contexts, b.num_generations, b.num_ctx_tokens, b.num_tokens) == (
        a.num_seqs, a.num_contexts, a.num_generations, a.num_ctx_tokens, a.num_tokens,
    )  # fmt: skip
    b.prepare()
    assert b.kv_lens_np.tolist() == a.kv_lens_np.tolist()
    assert b.slot_mapping(0).tolist() == a.slot_mapping(0).tolist()
    with pytest.raises(ValueError, match="num_contexts"):
        b.set_step([0], None, [0], [1], -1)
    assert b.num_seqs == 3  # a rejected step changes nothing
