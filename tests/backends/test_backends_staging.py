"""DeviceArena's async-copy rule: every queued copy reads a private snapshot.

The CPU test models a busy CUDA stream with a deferred copy queue (copies run only when
drained): each step's copy still delivers that step's values, because nothing writes its
snapshot again. The GPU tests do the same with real asynchronous copies behind a long kernel,
through torch's snapshots and through the ``PinnedRing`` (whose buffers are reused only after
their copy completed; a ring without that fence is shown to corrupt). (The persistent-buffer
hazard itself is shown in ``tests/cache/test_block_offsets.py``.)
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


def test_ring_needs_a_cuda_arena():
    with pytest.raises(ValueError, match="ring=True"):
        DeviceArena({"a": 4}, torch.device("cpu"), ring=True)
    assert DeviceArena({"a": 4}, torch.device("cpu")).ring is None


def stage_steps_behind_a_long_kernel(arena, steps: int) -> list[tuple[int, int]]:
    """Stage ``steps`` steps (step s writes s everywhere) while the stream is busy for ~0.1 s;
    returns what each step's copy delivered (min, max), read in stream order."""
    outs = []
    torch.cuda._sleep(200_000_000)  # GPU time ahead of every copy: the host runs ahead
    for step in range(steps):
        arena.stage({"a": np.full(1000, step, np.int32)})
        outs.append(arena.view("a").clone())  # enqueued after this step's copy
    torch.cuda.synchronize()
    return [(int(o.min()), int(o.max())) for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("ring", [True, False])
def test_gpu_arena_never_hands_a_pending_copy_a_later_step(ring):
    arena = DeviceArena({"a": 1000}, torch.device("cuda"), ring=ring)
    assert stage_steps_behind_a_long_kernel(arena, 8) == [(s, s) for s in range(8)]
    if ring:  # 4 buffers, each still in flight when its turn came again: torch snapshots
        assert arena.ring.sends == 4 and arena.ring.busy == 4
        assert arena.last_snapshot.is_pinned()
        torch.cuda.synchronize()  # all copies done: the ring serves again
        arena.stage({"a": np.full(1000, 42, np.int32)})
        assert arena.ring.sends == 5 and arena.last_snapshot is None
        assert int(arena.view("a").min()) == int(arena.view("a").max()) == 42
    else:
        assert arena.ring is None and arena.last_snapshot.is_pinned()


@pytest.mark.gpu
def test_gpu_ring_copies_on_the_current_stream():
    """Staged under a side stream, the ring's copy (and its fence) go on that stream: work
    queued there after prepare() sees the step's values, even while the side stream is
    held back by a long kernel."""
    arena = DeviceArena({"a": 1000}, torch.device("cuda"))
    with torch.cuda.stream(torch.cuda.Stream()):
        delivered = stage_steps_behind_a_long_kernel(arena, 3)
    assert delivered == [(s, s) for s in range(3)]
    assert arena.ring.sends == 3


@pytest.mark.gpu
def test_gpu_ring_without_its_fence_corrupts():
    """The negative control: a ring that hands out its buffer without checking the event
    lets later steps overwrite what a queued copy has not read yet."""
    from kvplan.backends.staging import PinnedRing

    class Unfenced(PinnedRing):
        def _copied(self, i):
            return True  # "done", whatever the state of the copy that reads buffer i

    arena = DeviceArena({"a": 1000}, torch.device("cuda"))
    arena.ring = Unfenced(torch.device("cuda"), slots=1)
    delivered = stage_steps_behind_a_long_kernel(arena, 4)
    assert delivered == [(3, 3)] * 4  # every queued copy read the last step's values


@pytest.mark.gpu
def test_gpu_ring_steps_aside_while_capturing():
    from kvplan.backends.staging import PinnedRing

    ring = PinnedRing(torch.device("cuda"))
    assert ring.acquire(8) is not None
    ring._slot = -1
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        refused = ring.acquire(8)
        x += 1
    graph.replay()
    torch.cuda.synchronize()
    assert refused is None and x.tolist() == [1.0] * 4


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
