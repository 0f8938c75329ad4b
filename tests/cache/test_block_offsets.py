"""copy_batch_block_offsets: row rules, widths, and the async-copy staging rule."""

import numpy as np
import pytest
import torch

from kvplan.cache import KVCacheManager
from kvplan.cache.batch_tables import expand_batch_rows, flat_block_ids, per_seq_table


def offsets_ref(m, request_ids, beam_width, num_contexts, *, cross=False):
    """Per-row loop over the manager's per-request lists: [num_pools, rows, 2, width]."""
    rows = []
    for i, rid in enumerate(request_ids):
        beams = 1 if i < num_contexts else beam_width
        for b in range(beams):
            rows.append((rid, b))
    out = np.zeros((m.num_pools, len(rows), 2, m.max_blocks_per_seq), dtype=np.int32)
    for p in range(m.num_pools):
        for r, (rid, b) in enumerate(rows):
            ids = m.get_cross_block_ids(rid, p) if cross else m.get_block_ids(rid, p, beam=b)
            out[p, r, 0, : len(ids)] = ids
            out[p, r, 1, : len(ids)] = ids
    return out


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    m = KVCacheManager(
        [64, 48],
        4,
        max_blocks_per_seq=6,
        window_sizes=(None, 16),
        layer_to_pool=[0, 1],
        max_beam_width=3,
    )
    m.add_request("junk", [1] * 7)  # makes pool ids differ from row order
    ids = []
    for i in range(5):
        beam = 1 if i < 2 else 3
        n = int(rng.integers(1, 14))
        assert m.add_request(f"r{i}", list(range(n)), beam_width=beam, num_encoder_tokens=i + 3).ok
        m.extend(f"r{i}", int(rng.integers(0, 6)))
        ids.append(f"r{i}")
    m.free("junk")
    m.extend("r0", 3)  # reuse freed blocks in pool order != request order
    return m, ids


@pytest.mark.parametrize("cross", [False, True])
def test_copy_matches_per_row_loop(cross):
    m, ids = make_batch()
    num_contexts, beam = 2, 3
    num_seqs = num_contexts + 3 * beam
    dst = torch.full((2, 16, 2, 6), -7, dtype=torch.int32)
    m.copy_batch_block_offsets(dst, ids, beam, num_contexts, num_seqs, cross=cross)
    want = offsets_ref(m, ids, beam, num_contexts, cross=cross)
    assert np.array_equal(dst[:, :num_seqs].numpy(), want)
    assert (dst[:, num_seqs:] == -7).all()  # rows past num_seqs untouched
    host = m.host_block_offsets(16, cross=cross)
    assert np.array_equal(host[:, :num_seqs].numpy(), want)  # persistent buffer for readers
    if cross:  # every beam row of a generation request names the same encoder blocks
        assert np.array_equal(want[:, 2], want[:, 3]) and np.array_equal(want[:, 3], want[:, 4])


@pytest.mark.parametrize("cross", [False, True])
def test_batch_tables_name_the_rows_of_the_per_row_loop(cross):
    m, ids = make_batch()
    bt = m.batch_tables(ids, 3, 2, cross=cross)
    want = offsets_ref(m, ids, 3, 2, cross=cross)[:, :, 0]  # [pools, rows, width]
    assert np.array_equal(bt.tables[:, bt.rows], want)
    counts = bt.num_allocated[bt.rows]
    assert counts.tolist() == [int((row != 0).sum()) for row in want[0]]
    assert not bt.tables.flags.writeable and not bt.num_allocated.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        bt.tables[0, 0, 0] = 5
    with pytest.raises(ValueError, match="beam_width 1, the batch says 3"):
        m.batch_tables(ids, 3, 1)  # a beam-1 request among the generation requests


def test_batch_tables_follow_the_tables_when_they_grow():
    m = KVCacheManager(400, 2, max_blocks_per_seq=4, enable_prefix_caching=False)
    m.add_request("a", [1, 2, 3])
    first = m.batch_tables(["a"])
    assert m.batch_tables(["a"]).tables is first.tables, "one read-only view per array"
    for i in range(70):  # past the initial 64 table rows: the manager reallocates its tables
        m.add_request(i, [1])
    bt = m.batch_tables(["a", 69])
    want = [m.get_block_ids("a") + [0, 0], m.get_block_ids(69) + [0] * 3]
    assert bt.tables[0, bt.rows].tolist() == want


def test_row_count_and_beam_checks():
    m, ids = make_batch()
    dst = torch.zeros((2, 16, 2, 6), dtype=torch.int32)
    with pytest.raises(ValueError, match="expect 11 rows"):
        m.copy_batch_block_offsets(dst, ids, 3, 2, 10)
    with pytest.raises(ValueError, match="beam_width 1, the batch says 3"):
        m.copy_batch_block_offsets(dst, ids, 3, 1, 1 + 4 * 3)
    with pytest.raises(ValueError, match="max_batch"):
        m.copy_batch_block_offsets(torch.zeros((2, 4, 2, 6), dtype=torch.int32), ids, 3, 2, 11)
    with pytest.raises(ValueError, match="shape"):
        m.copy_batch_block_offsets(torch.zeros((1, 16, 2, 6), dtype=torch.int32), ids, 3, 2, 11)
    with pytest.raises(TypeError, match="dtype"):
        m.copy_batch_block_offsets(torch.zeros((2, 16, 2, 6)), ids, 3, 2, 11)
    with pytest.raises(ValueError, match="unknown request id"):
        m.copy_batch_block_offsets(dst, ["r0", "zz"], 1, 2, 2)


def test_max_blocks_caps_the_copied_width():
    m, ids = make_batch()
    dst = torch.full((2, 16, 2, 6), -7, dtype=torch.int32)
    snap = m.copy_batch_block_offsets(dst, ids[:2], 1, 2, 2, max_blocks=2)
    assert snap.shape == (2, 2, 2, 2)
    want = offsets_ref(m, ids[:2], 1, 2)
    assert np.array_equal(dst[:, :2, :, :2].numpy(), want[..., :2])
    assert (dst[:, :2, :, 2:] == -7).all()
    m.copy_batch_block_offsets(dst, ids[:2], 1, 2, 2, max_blocks=0)  # at least one column
    assert np.array_equal(dst[:, :2, :, :1].numpy(), want[..., :1])


def test_persistent_buffer_has_no_stale_columns():
    m = KVCacheManager(32, 2, max_blocks_per_seq=8)
    m.add_request("long", list(range(15)))
    m.add_request("short", [1])
    dst = torch.zeros((1, 4, 2, 8), dtype=torch.int32)
    m.copy_batch_block_offsets(dst, ["long"], 1, 1, 1)
    m.copy_batch_block_offsets(dst, ["short"], 1, 1, 1)
    host = m.host_block_offsets(4)
    assert host[0, 0, 0].tolist() == m.get_block_ids("short") + [0] * 7


def test_helpers():
    assert expand_batch_rows([[3], [4, 7], [5, 6]], 2, 1, cross=False).tolist() == [3, 4, 7, 5, 6]
    assert expand_batch_rows([[3], [4, 7], [5, 6]], 2, 1, cross=True).tolist() == [3, 4, 4, 5, 5]
    table = np.array([[5, 6, 7, 0], [9, 8, 0, 0]], dtype=np.int32)
    assert flat_block_ids(table, np.array([1, 0]), np.array([1, 3])).tolist() == [9, 5, 6, 7]


class DeferredCopier:
    """A fake async copy engine: copies are queued and run later, like a busy CUDA stream."""

    def __init__(self):
        self.queue = []

    def __call__(self, dst, src):
        self.queue.append((dst, src))

    def run(self):
        for dst, src in self.queue:
            dst.copy_(src)
        self.queue.clear()


def two_batches():
    m = KVCacheManager(64, 4, max_blocks_per_seq=4)
    for i in range(4):
        m.add_request(i, list(range(5 + 3 * i)))
    return m, [0, 1], [2, 3]


def test_overwrite_hazard_of_the_persistent_buffer_and_the_snapshot_fix():
    m, step_t, step_t1 = two_batches()
    want_t = offsets_ref(m, step_t, 1, 2)
    # Hazard: the queued copy reads the persistent buffer, which the CPU refills for step
    # t+1 before the copy runs; the kernel of step t would read step t+1's blocks.
    copier = DeferredCopier()
    dst = torch.zeros((1, 4, 2, 4), dtype=torch.int32)
    stager = m.fill_host_block_offsets(step_t, 1, 2, 2, max_batch=4)
    copier(dst[:, :2], stager.host_block_offsets[:, :2])
    m.fill_host_block_offsets(step_t1, 1, 2, 2, max_batch=4)
    copier.run()
    assert not np.array_equal(dst[:, :2].numpy(), want_t)
    assert np.array_equal(dst[:, :2].numpy(), offsets_ref(m, step_t1, 1, 2))
    # Fix: copy_batch_block_offsets queues a copy from a private snapshot.
    dst.zero_()
    m.copy_batch_block_offsets(dst, step_t, 1, 2, 2, copy_fn=copier)
    m.fill_host_block_offsets(step_t1, 1, 2, 2, max_batch=4)
    copier.run()
    assert np.array_equal(dst[:, :2].numpy(), want_t)
    # ...while the persistent buffer still serves synchronous readers with the latest batch.
    assert np.array_equal(m.host_block_offsets(4)[:, :2].numpy(), offsets_ref(m, step_t1, 1, 2))


@pytest.mark.gpu
def test_overwrite_hazard_with_a_real_non_blocking_copy():
    m, step_t, step_t1 = two_batches()
    want_t = offsets_ref(m, step_t, 1, 2)
    dst = torch.zeros((1, 4, 2, 4), dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    # Hazard: the H2D copy waits behind a long kernel while the CPU refills the buffer.
    stager = m.fill_host_block_offsets(step_t, 1, 2, 2, max_batch=4)
    assert stager.host_block_offsets.is_pinned()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy
        dst[:, :2].copy_(stager.host_block_offsets[:, :2], non_blocking=True)
    m.fill_host_block_offsets(step_t1, 1, 2, 2, max_batch=4)
    stream.synchronize()
    assert np.array_equal(dst[:, :2].cpu().numpy(), offsets_ref(m, step_t1, 1, 2))
    # Fix: the copy reads a private pinned snapshot.
    dst.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        snap = m.copy_batch_block_offsets(dst, step_t, 1, 2, 2)
    assert snap.is_pinned()
    m.fill_host_block_offsets(step_t1, 1, 2, 2, max_batch=4)
    stream.synchronize()
    assert np.array_equal(dst[:, :2].cpu().numpy(), want_t)


def test_bad_dst_is_rejected_before_the_host_buffer_changes():
    m, step_t, step_t1 = two_batches()
    dst = torch.zeros((1, 4, 2, 4), dtype=torch.int32)
    m.copy_batch_block_offsets(dst, step_t, 1, 2, 2)
    before = m.host_block_offsets(4).clone()
    with pytest.raises(ValueError, match="dst must have shape"):
        m.copy_batch_block_offsets(torch.zeros((1, 4, 2, 3), dtype=torch.int32), step_t1, 1, 2, 2)
    with pytest.raises(ValueError, match="must be 4-D"):
        m.copy_batch_block_offsets(torch.zeros(4, dtype=torch.int32), step_t1, 1, 2, 2)
    assert torch.equal(m.host_block_offsets(4), before)


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True])
def test_copy_into_a_cuda_dst_matches_the_loop(cross):
    m, ids = make_batch()
    dst = torch.full((2, 16, 2, 6), -7, dtype=torch.int32, device="cuda")
    snap = m.copy_batch_block_offsets(dst, ids, 3, 2, 11, cross=cross, max_blocks=4)
    assert snap.is_pinned()
    torch.cuda.synchronize()
    want = offsets_ref(m, ids, 3, 2, cross=cross)
    got = dst.cpu().numpy()
    assert np.array_equal(got[:, :11, :, :4], want[..., :4])
    assert (got[:, :11, :, 4:] == -7).all() and (got[:, 11:] == -7).all()


def test_per_seq_table_is_a_fresh_c_contiguous_copy():
    """``per_seq_table`` relies on advanced indexing building a new C-ordered array."""
    table = np.arange(3 * 2 * 7, dtype=np.int32).reshape(3, 2, 7)[1:]  # a strided pool view
    rows = np.array([1, 0, 1], dtype=np.int64)
    out = per_seq_table(table[0], rows, 4)
    assert out.flags["C_CONTIGUOUS"] and out.flags["OWNDATA"] and out.dtype == np.int32
    assert out.tolist() == [table[0, 1, :4].tolist(), table[0, 0, :4].tolist()] + [
        table[0, 1, :4].tolist()
    ]
    out[0, 0] = -1
    assert table[0, 1, 0] != -1
