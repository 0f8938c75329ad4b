"""``DeviceExpander``: per-token and per-page fields expanded on the device from per-row facts.

The host writes O(rows) facts, the device expands O(rows x width) indices. A general step's
new tokens need a slot each (and, for the ragged backend, a position and a batch index), and
the ragged page table needs every page of every row: on the host that is a handful of numpy
passes over all tokens / pages per step. Instead the host stages only the per-row facts
(``cu_seqlens``, ``cached``, the block-table rows, ``indptr``) with the rest of the arena, and
ONE kernel (``_expand_kernel.expand_step_kernel``) writes those fields into their arena
fields on the device, in stream order after the staged copy.

Launch path: Triton's Python launcher binds and hashes the arguments on every call. The
kernel takes only a pointer and unspecialized ints, so one compiled kernel serves every step;
after the first launch of each flag set it is relaunched through its compiled launcher
directly (``CompiledKernel.run``: one C call). When a launch hook is installed (a profiler),
or under the interpreter, the normal path runs.

Consumers that want the expanded fields on the host (tests, debugging) recompute them with
numpy from the same per-row facts (each backend's ``*_np`` properties); the two paths are
held equal by ``tests/backends/test_backends_device_expand.py``.
"""

from __future__ import annotations

import torch

from kvplan.ops._dispatch import triton_interpreting
from kvplan.ops._launch import direct_launch, launch_hooks_installed

# tokens / pages per loop iteration of one row's program
EXPAND_BLOCK = 256


def expand_on_device_default(device: torch.device) -> bool:
    """Expansion runs on the device by default exactly when the arena lives on a GPU."""
    return torch.device(device).type == "cuda"


class DeviceExpander:
    """Launches ``expand_step_kernel`` over one arena's int32 buffer.

    Args:
        buffer: the arena's device buffer (every offset below is an element offset into it).
        num_pools: block-table pools (one slot field / page field per pool).
        slots64: slots are int64 (two int32 words per token) instead of int32.
        token_rows: also write ``positions`` and ``batch_indices`` per token.

    ``args = bind(tokens=..., pages=..., <offsets>)`` once, then ``launch(n, args)`` each
    step: program b (of ``n``) expands row b; see the kernel's docstring for what each offset
    names.
    """

    def __init__(
        self, buffer: torch.Tensor, *, num_pools: int, slots64: bool, token_rows: bool
    ) -> None:
        self.buffer = buffer
        self._ptr = buffer.data_ptr()
        self.num_pools = int(num_pools)
        self.slots64 = bool(slots64)
        self.token_rows = bool(token_rows)
        self._direct = buffer.is_cuda and not triton_interpreting()
        self._device_index = buffer.device.index if buffer.is_cuda else None
        # constexpr flags -> the compiled kernel's C launch entry and its fixed arguments
        self._launchers: dict[tuple, tuple | None] = {}

        from kvplan.backends.staging._expand_kernel import expand_step_kernel

        self._kernel = expand_step_kernel
        self.launches = 0  # kernels launched so far (tests check the path was taken)
        self.direct_launches = 0  # of which through the cached launcher

    def bind(
        self,
        *,
        tokens: bool,
        pages: bool,
        cu_off: int = 0,
        cached_off: int = 0,
        table_off: int,
        table_pool_stride: int,
        row_stride: int,
        slots_off: int = 0,
        slots_pool_stride: int = 0,
        pos_off: int = 0,
        bidx_off: int = 0,
        indptr_off: int = 0,
        indices_off: int = 0,
        indices_pool_stride: int = 0,
        block_size: int,
    ) -> tuple:
        """The kernel arguments of one expansion (see ``_expand_kernel``), to pass to
        ``launch`` step after step (callers keep it while the offsets stay the same)."""
        return (
            self.buffer, cu_off, cached_off, table_off, table_pool_stride, row_stride,
            slots_off, slots_pool_stride, pos_off, bidx_off, indptr_off, indices_off,
            indices_pool_stride, block_size,
            self.num_pools, tokens, self.slots64, self.token_rows and tokens, pages, EXPAND_BLOCK,
        )  # fmt: skip

    def launch(self, n: int, args: tuple) -> None:
        """Expand rows ``[0, n)`` with ``args`` from ``bind`` (queued on the current stream)."""
        if n == 0 or not (args[15] or args[18]):  # neither tokens nor pages
            return
        self.launches += 1
        key = args[15:19]  # the constexpr flags select the compiled kernel
        direct = self._launchers.get(key) if self._direct else None
        if direct is not None and not launch_hooks_installed():
            self.direct_launches += 1
            launch, function, coop, pdl, packed = direct
            stream = torch._C._cuda_getCurrentRawStream(self._device_index)
            # the buffer as its address: the launcher skips data_ptr() and a pointer query
            launch(n, 1, 1, stream, function, coop, pdl, None, None, packed, None, None, None,
                   self._ptr, *args[1:])  # fmt: skip
            return
        kernel = self._kernel[(n,)](*args)
        if self._direct and kernel is not None:
            self._launchers[key] = direct_launch(kernel)
