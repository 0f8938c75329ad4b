"""SnapshotRing: pinned staging slots reused round-robin, each fenced by an event.

The CPU tests model a busy CUDA stream with a deferred copy queue: a copy runs only when an
event recorded after it is synchronized (or at the end). Without the fence, a slot reused
while its copy is still queued hands that copy a later step's values; with it, every copy
delivers its own step. The GPU tests do the same with real ``non_blocking`` copies behind a
long kernel, and check the backends' arenas stage correctly through the ring.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import fill_metadata, make_scenario, random_specs, step_tensors, subset

from kvplan.backends import get_backend
from kvplan.backends.snapshot_ring import MIN_BUCKET, bucket_of
from kvplan.backends.staging import DeviceArena


class DeferredStream:
    """Copies queue up and run in order only when a fence forces them (or ``drain``)."""

    def __init__(self, fenced: bool = True) -> None:
        self.queue: list = []
        self.delivered: list[list[int]] = []  # what each executed copy wrote, in order
        self.fenced = fenced

    def copy(self, dst, src) -> None:
        self.queue.append((dst, src))

    def run_until(self, k: int) -> None:
        while len(self.delivered) < k:
            dst, src = self.queue[len(self.delivered)]
            dst.copy_(src)
            self.delivered.append(dst.tolist())

    def drain(self) -> None:
        self.run_until(len(self.queue))

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: DeferredStream) -> None:
        self.stream, self.mark = stream, 0

    def record(self) -> None:
        self.mark = len(self.stream.queue)

    def synchronize(self) -> None:
        if self.stream.fenced:
            self.stream.run_until(self.mark)


def staged_steps(stream: DeferredStream, num_slots: int, num_steps: int) -> list[list[int]]:
    arena = DeviceArena({"a": 3, "b": 5}, torch.device("cpu"), private_snapshots=True,
                        ring_slots=num_slots, copy_fn=stream.copy, event_factory=stream.event)  # fmt: skip
    for step in range(num_steps):
        arena.stage({"a": np.full(3, step, np.int32), "b": np.full(5, 10 * step, np.int32)})
    stream.drain()
    return stream.delivered


def test_fenced_ring_delivers_every_step_while_copies_are_queued():
    delivered = staged_steps(DeferredStream(), num_slots=3, num_steps=10)
    assert delivered == [[s] * 3 + [10 * s] * 5 for s in range(10)]


def test_unfenced_reuse_is_the_hazard_the_fence_prevents():
    delivered = staged_steps(DeferredStream(fenced=False), num_slots=3, num_steps=10)
    assert delivered[0] == [9] * 3 + [90] * 5, "copy 0 read slot 0 after step 9 rewrote it"


def test_ring_reuses_its_slots_and_matches_fresh_snapshots():
    fields = {"a": 6, "b": 9}
    ring = DeviceArena(fields, torch.device("cpu"), private_snapshots=True, ring_slots=2)
    fresh = DeviceArena(fields, torch.device("cpu"), private_snapshots=True)
    ptrs = []
    for step in range(5):
        values = {"a": np.arange(step + 1, dtype=np.int32), "b": np.full(9 - step, step, np.int32)}
        ring.stage(values)
        fresh.stage(values)
        ptrs.append(ring.last_snapshot.data_ptr())
        for name, arr in values.items():
            assert ring.view(name)[: arr.size].tolist() == arr.tolist()
            assert fresh.view(name)[: arr.size].tolist() == arr.tolist()
    assert ptrs[0] == ptrs[2] == ptrs[4] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
    with pytest.raises(ValueError, match="num_slots"):
        DeviceArena(fields, torch.device("cpu"), private_snapshots=True, ring_slots=1)


def test_bucket_of():
    assert bucket_of(1, 10**6) == MIN_BUCKET
    assert bucket_of(MIN_BUCKET + 1, 10**6) == 2 * MIN_BUCKET
    assert bucket_of(70000, 10**6) == 131072
    assert bucket_of(70000, 80000) == 80000  # never past the arena
    assert bucket_of(5, 8) == 8


def test_metadata_ring_setting():
    cls = get_backend("ragged").Metadata
    assert cls(max_num_requests=2, max_num_tokens=8).staging_ring_slots == 0  # CPU: in place
    assert cls(max_num_requests=2, max_num_tokens=8, staging_ring_slots=3).staging_ring_slots == 3
    with pytest.raises(ValueError, match="staging_ring_slots"):
        cls(max_num_requests=2, max_num_tokens=8, staging_ring_slots=1)


@pytest.mark.gpu
def test_gpu_ring_never_hands_a_pending_copy_a_later_step():
    arena = DeviceArena({"a": 1000}, torch.device("cuda"), ring_slots=2)
    assert arena.ring is not None
    outs = []
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy: the host runs ahead
    for step in range(8):
        arena.stage({"a": np.full(1000, step, np.int32)})
        outs.append(arena.view("a").clone())  # enqueued after this step's copy
    torch.cuda.synchronize()
    assert [(int(o.min()), int(o.max())) for o in outs] == [(s, s) for s in range(8)]
    assert arena.last_snapshot.is_pinned()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_gpu_ring_and_fresh_snapshots_stage_the_same_steps(name):
    specs = random_specs(9, num_ctx=3, num_gen=6)
    sc = make_scenario(9, specs, layer_windows=(None, 8), device="cuda")
    cap = {"max_num_requests": 16, "max_num_tokens": 256, "max_num_sequences": 32}
    cls = get_backend(name).Metadata
    ring = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, staging_ring_slots=2, **cap)
    fresh = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, staging_ring_slots=0, **cap)
    assert ring.arena.ring is not None and fresh.arena.ring is None
    for step, batch in enumerate([sc, subset(sc, [4, 6, 8]), subset(sc, [0, 7]), sc, sc]):
        torch.cuda._sleep(50_000_000)  # queued copies while the host prepares the next step
        for md in (ring, fresh):
            fill_metadata(md, batch)
            md.prepare()
        pools = sc.manager.num_pools
        assert step_tensors(ring, name, pools) == step_tensors(fresh, name, pools), step
