"""DeviceArena's async-copy rule: every queued copy reads a fresh private snapshot.

The CPU test models a busy CUDA stream with a deferred copy queue (copies run only when
drained): each step's copy still delivers that step's values, because nothing writes its
snapshot again. The GPU test does the same with real ``non_blocking`` copies behind a long
kernel. (The persistent-buffer hazard itself is shown in ``tests/cache/test_block_offsets.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplan.backends.staging import DeviceArena


class DeferredCopies:
    """Copies queue up and run, in order, only on ``drain``."""

    def __init__(self) -> None:
        self.queue: list = []

    def copy(self, dst, src) -> None:
        self.queue.append((dst, src))

    def drain(self) -> list[list[int]]:
        delivered = []
        for dst, src in self.queue:
            dst.copy_(src)
            delivered.append(dst.tolist())
        self.queue.clear()
        return delivered


def test_queued_copies_each_deliver_their_own_step():
    copies = DeferredCopies()
    arena = DeviceArena({"a": 3, "b": 5}, torch.device("cpu"), private_snapshots=True,
                        copy_fn=copies.copy)  # fmt: skip
    for step in range(6):
        arena.stage({"a": np.full(3, step, np.int32), "b": np.full(5, 10 * step, np.int32)})
    assert copies.drain() == [[s] * 3 + [10 * s] * 5 for s in range(6)]


@pytest.mark.gpu
def test_gpu_arena_never_hands_a_pending_copy_a_later_step():
    arena = DeviceArena({"a": 1000}, torch.device("cuda"))
    outs = []
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy: the host runs ahead
    for step in range(8):
        arena.stage({"a": np.full(1000, step, np.int32)})
        outs.append(arena.view("a").clone())  # enqueued after this step's copy
    torch.cuda.synchronize()
    assert [(int(o.min()), int(o.max())) for o in outs] == [(s, s) for s in range(8)]
    assert arena.last_snapshot.is_pinned()


def garbage_snapshots(md) -> None:
    """Make ``md``'s arena stage through private snapshots on the CPU, each filled with -7
    first (what uninitialized pinned memory may hold), so a field a step leaves unwritten
    shows up on the "device"."""
    arena = md.arena
    arena.private_snapshots, arena._buffer_np = True, None
    begin = arena.begin

    def dirty_begin(end):
        host = begin(end)
        host.fill(-7)
        return host

    arena.begin = dirty_begin


@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
@pytest.mark.parametrize("manager", [True, False])
def test_seq_lens_survive_a_second_prepare_and_an_early_read(name, manager):
    """seq_lens is staged in every snapshot: a second prepare() of the same step, or a read
    of seq_lens_gpu before prepare(), must not leave the device copy to snapshot garbage."""
    from backends_testlib import SeqSpec, fill_metadata, make_scenario

    from kvplan.backends import get_backend

    sc = make_scenario(3, [SeqSpec(5, 3, True), SeqSpec(9, 1, False)])
    kw = {"kv_cache_manager": sc.manager, "kv_cache": sc.kv} if manager else {}
    md = get_backend(name).Metadata(max_num_requests=4, max_num_tokens=64, **kw)
    md.expand_on_device = False
    garbage_snapshots(md)
    if manager:
        fill_metadata(md, sc)
    else:  # context-only batch without a cache
        md.request_ids, md.num_contexts, md.seq_lens = [0, 1], 2, [3, 2]
    want = md.seq_lens_np.tolist() if hasattr(md, "seq_lens_np") else list(md._seq_lens_np)
    assert md.seq_lens_gpu.tolist() == want  # read before prepare(): copied on the spot
    md.prepare()
    assert md.seq_lens_gpu.tolist() == want
    md.prepare()  # same step again, no setter in between
    assert md.seq_lens_gpu.tolist() == want
