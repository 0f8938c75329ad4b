"""Private pinned staging snapshots without a host allocation per step.

``DeviceArena`` stages each step through a private pinned snapshot (the async-copy rule of
``kvplan.backends.staging``). Allocating it per step (``torch.empty(pin_memory=True)``) goes
through the host caching allocator, and the copy then needs fresh tensor views; on a slow
host those calls cost tens of microseconds per step. ``SnapshotRing`` keeps ``num_slots``
pinned buffers and hands them out round-robin instead:

* step t stages into slot ``t % num_slots`` and copies from it (one ``non_blocking`` copy), then
  records an event on the stream that issued the copy;
* before slot i is handed out again (``num_slots`` steps later), that event is synchronized:
  the copy that read slot i has completed, so nothing a later step writes can reach it.

Each copy covers a power-of-two "bucket" of entries (at least ``MIN_BUCKET``, at most the
arena), so the source and destination views are made once per (slot, bucket) and reused;
entries between the staged prefix and the bucket end reach the device with unspecified
values, like every field a step does not stage.

Example::

    ring = SnapshotRing(arena_buffer, num_slots=4)
    host = ring.take(end)      # numpy int32 view of a free slot, fill host[:end]
    ring.send(end)             # one async copy into arena_buffer[:bucket], fenced by an event
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

MIN_BUCKET = 4096  # int32 entries (16 KiB): smaller copies gain nothing from being shorter

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def bucket_of(end: int, size: int) -> int:
    """The copied length for a prefix of ``end`` entries: the next power of two, at least
    ``MIN_BUCKET`` and at most ``size`` (the arena)."""
    return min(max(1 << (end - 1).bit_length(), MIN_BUCKET), size)


class _Slot:
    __slots__ = ("event", "host", "tensor", "views")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None  # pinned int32 [capacity]
        self.host = np.zeros(0, np.int32)  # numpy view of tensor
        self.event: Any = None  # recorded after the slot's last copy
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (src, dst)


class SnapshotRing:
    """``num_slots`` pinned int32 staging buffers for copies into ``buffer``.

    Args:
        buffer: the arena's int32 device buffer (1-D).
        num_slots: slots in the ring (>= 2); a slot is reused ``num_slots`` steps later.
        pinned: allocate the slots in pinned memory (CUDA).
        copy_fn: ``copy_fn(dst, src)`` issues the copy (default: ``non_blocking`` copy_).
        event_factory: makes the fence objects (``record()``, ``synchronize()``); default
            ``torch.cuda.Event`` for a CUDA buffer, none for a CPU buffer (its copies are
            synchronous). Tests pass a fake one with a deferred ``copy_fn``.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        num_slots: int,
        *,
        pinned: bool,
        copy_fn: CopyFn,
        event_factory: Callable[[], Any] | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2, got {num_slots}")
        self.buffer = buffer
        self.size = buffer.numel()
        self.pinned = pinned
        self._copy = copy_fn
        # the copy runs on the current stream of the destination's device: fence that stream
        self._cuda_device = buffer.device if buffer.device.type == "cuda" else None
        if event_factory is None and self._cuda_device is not None:
            event_factory = torch.cuda.Event
        self._event_factory = event_factory
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        self._current: _Slot | None = None

    def take(self, end: int) -> np.ndarray:
        """The next slot's host view (int32, at least ``end`` entries), free to write: its
        previous copy has completed."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()  # normally long done: num_slots steps ago
        bucket = bucket_of(end, self.size)
        if slot.host.size < bucket:  # grow: the old tensor's copy is fenced by its allocator
            slot.tensor = torch.empty(bucket, dtype=torch.int32, pin_memory=self.pinned)
            slot.host = slot.tensor.numpy()
            slot.views = {}
        self._current = slot
        return slot.host

    def send(self, end: int) -> torch.Tensor | None:
        """Copy the taken slot's first ``bucket_of(end)`` entries into ``buffer`` and fence
        the slot; returns the slot's tensor (for inspection)."""
        slot, self._current = self._current, None
        if slot is None or end == 0:
            return None
        bucket = bucket_of(end, self.size)
        pair = slot.views.get(bucket)
        if pair is None:
            pair = slot.views[bucket] = (slot.tensor[:bucket], self.buffer[:bucket])
        self._copy(pair[1], pair[0])
        if self._event_factory is not None:
            if slot.event is None:
                slot.event = self._event_factory()
            if self._cuda_device is None:
                slot.event.record()
            else:  # the stream that runs the copy (the destination device's current stream)
                slot.event.record(torch.cuda.current_stream(self._cuda_device))
        return slot.tensor
