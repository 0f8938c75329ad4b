"""``PinnedRing``: the arena's private snapshots on a GPU, without torch's per-copy host work.

The staging rule (``kvplan.backends.staging``) asks for a private host snapshot per copy.
Through torch that is a ``torch.empty(pin_memory=True)`` plus a ``copy_(non_blocking=True)``
per step (the caching host allocator's bookkeeping and the dispatcher: host time comparable
to ``prepare()``'s numpy math on a small batch; ``bench/step_parts.py`` measures it).
``PinnedRing`` keeps the same rule with less host work:

* a few pinned buffers, reused round-robin; each carries a CUDA event recorded right after
  the copy that reads it. A buffer is handed out again only once its event has completed,
  i.e. once the copy that read it is done, so no copy ever reads a buffer the host is
  writing (the guarantee the caching host allocator gives, kept here by the ring itself).
  When the next buffer is still in flight (the host runs several steps ahead of the
  device), ``acquire`` returns None and the caller takes a fresh torch snapshot: never a
  wait, never a hazard.
* the copy and the event record are the CUDA runtime's own ``cudaMemcpyAsync`` /
  ``cudaEventRecord`` on torch's current stream, called through ``ctypes`` on the very
  ``libcudart`` torch loaded (same context, same streams).
* a stream that is capturing a CUDA graph is left to torch's path (an event query there would
  invalidate the capture), checked each step.

Without CUDA, or when torch's ``libcudart`` cannot be found (a static build), ``cudart()``
returns None and ``DeviceArena`` keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
MEMCPY_HOST_TO_DEVICE = 1
EVENT_DISABLE_TIMING = 2


@functools.cache
def cudart() -> ctypes.CDLL | None:
    """The ``libcudart`` this process's torch uses, with the signatures set, or None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = None
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if "libcudart.so" in os.path.basename(name):
                    path = name
                    break
    except OSError:
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    vp, i = ctypes.c_void_p, ctypes.c_int
    sigs = {
        "cudaMemcpyAsync": [vp, vp, ctypes.c_size_t, i, vp],
        "cudaEventCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
        "cudaEventRecord": [vp, vp],
        "cudaEventQuery": [vp],
        "cudaEventSynchronize": [vp],
        "cudaEventDestroy": [vp],
        "cudaGetErrorString": [i],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else i
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        msg = lib.cudaGetErrorString(rc).decode(errors="replace")
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({msg})")


class PinnedRing:
    """``slots`` pinned int32 host buffers, each reused only after the copy that read it.

    Args:
        device: the CUDA device the copies go to (their stream is torch's current stream on
            it at ``acquire`` time).
        slots: buffers in the ring (how many steps' copies may be in flight at once).
        lib: the CUDA runtime (default: ``cudart()``; must not be None).

    One step: ``host = ring.acquire(n)`` (None: use another snapshot this step), write
    ``host[:n]``, then ``ring.send(dst_ptr, nbytes)``.
    """

    def __init__(self, device: torch.device, slots: int = 4, lib: ctypes.CDLL | None = None):
        lib = lib or cudart()
        if lib is None:
            raise RuntimeError("PinnedRing needs the CUDA runtime (cudart() found none)")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.lib = lib
        self.device_index = torch.device(device).index
        if self.device_index is None:
            self.device_index = torch.cuda.current_device()
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._arrays: list[np.ndarray | None] = [None] * slots
        self._ptrs = [0] * slots
        self._events = []
        for _ in range(slots):
            ev = ctypes.c_void_p()
            _check(lib, lib.cudaEventCreateWithFlags(ctypes.byref(ev), EVENT_DISABLE_TIMING),
                   "cudaEventCreateWithFlags")  # fmt: skip
            self._events.append(ev)
        self._next = 0
        self._slot = -1  # the slot acquire() handed out, until send()
        self._stream = 0
        self.sends = 0  # copies sent through the ring (tests check the path was taken)
        self.busy = 0  # acquires refused because the next buffer was still in flight

    def acquire(self, n: int) -> np.ndarray | None:
        """A host int32 array of at least ``n`` entries that no pending copy reads, or None
        (the next buffer is still being copied, the stream is capturing a graph, or another
        device is current: torch's path then handles the step)."""
        if torch._C._cuda_getDevice() != self.device_index:
            return None
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        i = self._next
        if not self._copied(i):
            self.busy += 1
            return None
        arr = self._arrays[i]
        if arr is None or arr.size < n:  # grow to the next power of two (rarely)
            size = 1 << max(n - 1, 1023).bit_length()
            buf = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._buffers[i], arr = buf, buf.numpy()
            self._arrays[i], self._ptrs[i] = arr, buf.data_ptr()
        self._next = (i + 1) % len(self._events)
        self._slot, self._stream = i, stream
        return arr

    def _copied(self, i: int) -> bool:
        """Whether the last copy that read buffer ``i`` has completed (true before any)."""
        rc = self.lib.cudaEventQuery(self._events[i])
        if rc == CUDA_ERROR_NOT_READY:
            return False
        _check(self.lib, rc, "cudaEventQuery")
        return True

    def send(self, dst_ptr: int, nbytes: int) -> None:
        """Copy the first ``nbytes`` of the acquired buffer to device address ``dst_ptr`` on
        the stream seen at ``acquire``, and fence the buffer behind that copy."""
        i, lib = self._slot, self.lib
        if i < 0:
            raise RuntimeError("PinnedRing.send() without a buffer from acquire()")
        self._slot = -1
        rc = lib.cudaMemcpyAsync(dst_ptr, self._ptrs[i], nbytes, MEMCPY_HOST_TO_DEVICE,
                                 self._stream)  # fmt: skip
        if rc:
            _check(lib, rc, "cudaMemcpyAsync")
        rc = lib.cudaEventRecord(self._events[i], self._stream)
        if rc:
            _check(lib, rc, "cudaEventRecord")
        self.sends += 1

    def __del__(self) -> None:
        # the buffers go back to torch's host allocator, which knows nothing of the copies
        # that read them: wait for those first
        lib = getattr(self, "lib", None)
        for ev in getattr(self, "_events", ()):
            try:
                lib.cudaEventSynchronize(ev)
                lib.cudaEventDestroy(ev)
            except Exception:  # interpreter shutdown: the runtime may be gone already
                pass
