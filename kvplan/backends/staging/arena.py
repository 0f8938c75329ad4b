"""``DeviceArena``: one step's int32 metadata fields, staged in one async copy.

``DeviceArena`` packs many small int32 device buffers into one allocation at fixed offsets
(capacity-sized, so their addresses never change and CUDA graphs can record them) and fills
the used ones with ONE private host snapshot + ONE ``non_blocking`` copy per step (the
staging rule of ``kvplan.backends.staging``). On a GPU the snapshot comes from a
``PinnedRing`` (pinned buffers reused only after their copy completed, copied with the CUDA
runtime's own calls); a step the ring cannot serve (every buffer still in flight, a capturing
stream) takes a fresh ``torch.empty(pin_memory=True)`` snapshot, which torch's caching host
allocator recycles only after the copies that read it have completed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from kvplan._checks import INT32_MAX
from kvplan.backends.staging.pinned_ring import PinnedRing, cudart

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def use_pinned(device: torch.device) -> bool:
    """Pinned host memory only pays off (and only exists) when copying to a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_empty(n: int | tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A fresh host tensor, pinned when ``pinned`` (the caching host allocator recycles it
    only after the copies that read it have completed)."""
    return torch.empty(n, dtype=dtype, pin_memory=pinned)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)``; a CPU ``dst`` is written through numpy (a small
    torch CPU copy may fan out over threads and stall when the cores are busy)."""
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


class DeviceArena:
    """Named int32 device buffers at fixed offsets of one allocation.

    Args:
        capacities: field name -> number of int32 elements reserved for it (order = layout;
            put the fields whose used length varies most at the end).
        device: where the buffers live.
        private_snapshots: stage through a private host snapshot + one copy (default: when
            ``device`` is not the CPU). A CPU arena has no asynchronous copy to protect, so by
            default ``stage`` writes its buffer in place (no snapshot, no second memcpy);
            ``True`` forces the snapshot path (tests use it to check the rule on the CPU).
        copy_fn: ``copy_fn(dst, src)`` issues the step's copy (default: ``non_blocking``
            ``copy_``); tests inject a deferred copy to model a busy stream on the CPU.
        ring: stage through a ``PinnedRing`` (default: on a GPU with private snapshots, the
            default copy and the CUDA runtime found; else torch's snapshot + ``copy_``).

    ``view(name)`` is a capacity-sized int32 view that never moves. One step stages with
    ``host = begin(end)`` (a private host snapshot of the arena prefix ``[0, end)``), writes
    its fields into ``host`` (``put(host, name, arr)``, or computes straight into
    ``out(host, name, size)`` with numpy ``out=``), then ``commit()``: ONE ``non_blocking``
    copy. ``stage(values)`` does all three for a dict of arrays. Fields not written in a step
    hold unspecified values afterwards (each step must stage every field it relies on).

    Example::

        arena = DeviceArena({"indptr": 9, "indices": 64}, device)
        arena.stage({"indptr": np.array([0, 3, 5], np.int32), "indices": ids})
        arena.view("indptr")[:3]   # tensor([0, 3, 5], dtype=torch.int32)
        host = arena.begin(arena.end_of("indices", 2))     # the same, field by field
        arena.put(host, "indptr", np.array([0, 2], np.int32))
        np.add(ids[:2], 1, out=arena.out(host, "indices", 2))
        arena.commit()
    """

    def __init__(
        self,
        capacities: Mapping[str, int],
        device: torch.device,
        private_snapshots: bool | None = None,
        *,
        copy_fn: CopyFn | None = None,
        ring: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.pinned = use_pinned(self.device)
        if private_snapshots is None:
            private_snapshots = self.device.type != "cpu"
        self.private_snapshots = private_snapshots
        self.offsets: dict[str, int] = {}
        self.capacities = dict(capacities)
        total = 0
        for name, cap in self.capacities.items():
            if cap < 0:
                raise ValueError(f"capacity of {name} must be >= 0, got {cap}")
            self.offsets[name] = total
            total += int(cap)
        if total > INT32_MAX:
            raise ValueError(f"arena of {total} int32 elements overflows int32 offsets")
        self.size = max(total, 1)
        self.buffer = torch.zeros(self.size, dtype=torch.int32, device=self.device)
        self._views = {
            name: self.buffer[off : off + self.capacities[name]]
            for name, off in self.offsets.items()
        }
        self._spans = {name: (off, self.capacities[name]) for name, off in self.offsets.items()}
        self._prefixes: dict[tuple, torch.Tensor] = {}
        self._buffer_np = None if private_snapshots else self.buffer.numpy()
        self._copy = copy_to if copy_fn is None else copy_fn
        # commit() on a GPU with the default copy: dst.copy_ straight away (no wrapper call)
        self._copy_cuda = copy_fn is None and self.device.type == "cuda"
        self._dst: dict[int, torch.Tensor] = {}  # staged prefix end -> buffer[:end]
        self._pending: tuple[torch.Tensor | None, int] | None = None
        self.last_snapshot: torch.Tensor | None = None
        usable = self._copy_cuda and private_snapshots and cudart() is not None
        if ring and not usable:
            raise ValueError(
                "ring=True needs a CUDA arena with private snapshots, the default copy and "
                "the CUDA runtime"
            )
        self.ring = PinnedRing(self.device) if (usable if ring is None else ring) else None
        self._buffer_ptr = self.buffer.data_ptr()

    def view(self, name: str) -> torch.Tensor:
        return self._views[name]

    def prefix(
        self,
        name: str,
        size: int,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """``view(name)[:size]``, reinterpreted as ``dtype`` and viewed as ``shape`` when
        given, made once per (name, size, dtype, shape) and then looked up: per-step and
        per-layer readers of a field skip the tensor slicing (a dispatcher call each) while
        the sizes repeat."""
        key = (name, size, dtype, shape)
        hit = self._prefixes.get(key)
        if hit is None:
            if len(self._prefixes) >= 512:  # sizes that vary every step: stay bounded
                self._prefixes.clear()
            hit = self._views[name][:size]
            if dtype is not None:
                hit = hit.view(dtype)
            if shape is not None:
                hit = hit.view(shape)
            self._prefixes[key] = hit
        return hit

    def end_of(self, name: str, size: int) -> int:
        """Arena offset just past ``size`` entries of field ``name`` (a staging prefix end)."""
        return self._spans[name][0] + size

    def begin(self, end: int) -> np.ndarray:
        """Start one step's staging of the arena prefix ``[0, end)``: returns the host int32
        array to fill at arena offsets (through ``put`` / ``out``), then call ``commit()``.

        On a device arena it is a private pinned snapshot of ``end`` entries (a ring buffer
        that no pending copy reads, else a fresh torch one); on a CPU
        arena without private snapshots it is the buffer itself (written in place). Entries of
        the prefix that this step does not write reach the device with unspecified values.
        """
        if end > self.size:
            raise ValueError(f"staging prefix of {end} entries exceeds the arena ({self.size})")
        if self._buffer_np is not None:
            self._pending = None
            return self._buffer_np
        if self.ring is not None:
            host = self.ring.acquire(end)
            if host is not None:  # None: every ring buffer in flight; a torch snapshot
                self._pending = (None, end)
                return host[:end]
        snapshot = torch.empty(end, dtype=torch.int32, pin_memory=self.pinned)
        self._pending = (snapshot, end)
        return snapshot.numpy()

    def put(self, host: np.ndarray, name: str, arr: np.ndarray) -> None:
        """Write 1-D ``arr`` to the start of field ``name`` in ``host`` (from ``begin``)."""
        off, cap = self._spans[name]
        size = arr.size
        if size > cap:
            raise ValueError(f"{name} needs {size} entries, more than its capacity {cap}")
        host[off : off + size] = arr

    def out(self, host: np.ndarray, name: str, size: int) -> np.ndarray:
        """The first ``size`` entries of field ``name`` in ``host``, to compute into (``out=``)."""
        off, cap = self._spans[name]
        if size > cap:
            raise ValueError(f"{name} needs {size} entries, more than its capacity {cap}")
        return host[off : off + size]

    def commit(self) -> None:
        """Send what ``begin`` handed out: ONE ``non_blocking`` copy of the staged prefix from
        its private snapshot (nothing to do for an in-place CPU arena)."""
        if self._pending is None:
            return
        snapshot, end = self._pending
        self._pending = None
        if snapshot is None:  # a ring buffer (its entries past `end` are not sent)
            if end:
                self.ring.send(self._buffer_ptr, 4 * end)
            self.last_snapshot = None
            return
        if end:
            dst = self._dst.get(end)
            if dst is None:  # a device slice is a dispatcher call: made once per prefix end
                if len(self._dst) >= 256:
                    self._dst.clear()
                dst = self._dst[end] = self.buffer[:end]
            if self._copy_cuda:
                dst.copy_(snapshot, non_blocking=True)
            else:
                self._copy(dst, snapshot)
        # Kept only for inspection; the allocator already protects it until the copy is done.
        self.last_snapshot = snapshot

    def stage(self, values: Mapping[str, np.ndarray]) -> None:
        """``begin`` + ``put`` of every given 1-D array + ``commit`` (the prefix that covers
        them); a no-op when every array is empty."""
        spans = self._spans
        end = 0
        for name, arr in values.items():
            off, cap = spans[name]
            if arr.size > cap:
                raise ValueError(f"{name} needs {arr.size} entries, more than its capacity {cap}")
            end = max(end, off + arr.size)
        if end == 0:
            return
        host = self.begin(end)
        for name, arr in values.items():
            off = spans[name][0]
            host[off : off + arr.size] = arr
        self.commit()


def to_device(
    arr: np.ndarray, device: torch.device, dtype: torch.dtype | None = torch.int32
) -> torch.Tensor:
    """A new device tensor holding ``arr`` (as ``dtype``; None: ``arr``'s own dtype), copied
    asynchronously from a private snapshot (on CUDA: pinned, so the copy neither waits for the
    kernels queued before it nor lets the host run ahead of a still-pending read)."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
    snapshot = host_empty(arr.shape, dtype, use_pinned(device))
    snapshot.numpy()[...] = arr
    if device.type == "cpu":
        return snapshot
    return snapshot.to(device, non_blocking=True)
