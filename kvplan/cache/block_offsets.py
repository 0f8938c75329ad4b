"""Block offsets: the 4-D block table of the block-offsets backend, and the staging rule.

``BlockOffsetsStager`` owns the persistent host table ``[num_pools, max_batch, 2,
max_blocks_per_seq]`` int32 (index 0 of dim 2 = K, 1 = V). K and V live in separate tensors
indexed by the same block id, so both entries hold the block id itself.

Staging rule: the persistent host buffer ``host_block_offsets`` is filled in place
and stays for synchronous CPU readers (it keeps ``max_batch`` rows across calls); every async
host-to-device copy reads a *private* pinned snapshot of the rows it needs. Reusing the
persistent buffer as the copy source is a hazard: when the CPU runs one step ahead it refills
the buffer before the previous step's queued copy has executed, and the kernel then reads
the next batch's blocks. ``tests/cache/test_block_offsets.py`` shows that hazard and its fix.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvplan._checks import check_tensor

__all__ = ["BlockOffsetsStager", "CopyFn", "check_block_offsets_dst", "default_copy"]

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)``: async when src is pinned and dst is on a GPU
    (a CPU ``dst`` is written synchronously through numpy)."""
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


def check_block_offsets_dst(
    dst: torch.Tensor, num_pools: int, max_blocks_per_seq: int, num_rows: int
) -> None:
    """``dst`` must be int32 ``[num_pools, >= num_rows, 2, max_blocks_per_seq]``."""
    check_tensor("dst", dst, dtype=torch.int32, ndim=4)
    if (dst.shape[0], dst.shape[2], dst.shape[3]) != (num_pools, 2, max_blocks_per_seq):
        raise ValueError(
            f"dst must have shape ({num_pools}, max_batch, 2, {max_blocks_per_seq}), "
            f"got {tuple(dst.shape)}"
        )
    if num_rows > dst.shape[1]:
        raise ValueError(f"num_seqs = {num_rows} exceeds dst's max_batch = {dst.shape[1]}")


class BlockOffsetsStager:
    """Owns the persistent host block-offset buffer and stages private snapshots from it.

    Args:
        num_pools, max_batch, max_blocks_per_seq: the buffer shape is
            ``[num_pools, max_batch, 2, max_blocks_per_seq]`` int32 (CPU, pinned when CUDA is
            available).
    """

    def __init__(self, num_pools: int, max_batch: int, max_blocks_per_seq: int) -> None:
        self.shape = (num_pools, max_batch, 2, max_blocks_per_seq)
        self.pin = torch.cuda.is_available()
        self.host_block_offsets = torch.zeros(self.shape, dtype=torch.int32, pin_memory=self.pin)
        self._host_np = self.host_block_offsets.numpy()  # shares memory
        # Columns that may hold nonzero entries anywhere in the buffer (monotone).
        self._dirty_width = 0

    def fill(self, tables: np.ndarray, seq_rows: np.ndarray, num_allocated: np.ndarray) -> None:
        """Write ``tables[:, seq_rows]`` into buffer rows ``[0, len(seq_rows))`` for K and V.

        ``tables``: ``[num_pools, rows, max_blocks_per_seq]`` int32; ``num_allocated[r]``: the
        allocated count of table row r. Columns past a row's count are written as 0 (up to
        the widest column ever written), so the buffer holds exact rows for every reader.
        """
        n = seq_rows.size
        if n > self.shape[1]:
            raise ValueError(f"num_seqs = {n} exceeds the buffer's max_batch = {self.shape[1]}")
        width = int(np.maximum.reduce(num_allocated[seq_rows])) if n else 0
        fill_width = max(width, self._dirty_width)
        self._dirty_width = fill_width
        if n == 0 or fill_width == 0:
            return
        # one gather, broadcast over dim 2 (K and V name the same block)
        self._host_np[:, :n, :, :fill_width] = tables[:, seq_rows, None, :fill_width]

    def snapshot(self, num_rows: int, width: int) -> torch.Tensor:
        """A private (pinned when possible) copy of ``host_block_offsets[:, :num_rows, :, :width]``.

        Nothing else ever writes it, so an async copy reading it cannot see a later batch.
        """
        snap = torch.empty(
            (self.shape[0], num_rows, 2, width), dtype=torch.int32, pin_memory=self.pin
        )
        # numpy copy: a small torch CPU copy_ may spread over threads and stall when cores
        # are busy; this is one memcpy per row.
        np.copyto(snap.numpy(), self._host_np[:, :num_rows, :, :width])
        return snap

    def copy_to(
        self, dst: torch.Tensor, num_rows: int, width: int, copy_fn: CopyFn | None = None
    ) -> torch.Tensor:
        """Copy rows ``[0, num_rows)``, columns ``[0, width)`` into ``dst`` through a snapshot.

        ``dst``: int32 ``[num_pools, >= num_rows, 2, max_blocks_per_seq]`` on any device,
        checked by the caller (``check_block_offsets_dst``). Columns ``>= width`` of ``dst``
        are left as they were. Returns the snapshot (the copy's source), which callers may
        keep alive until the copy completes.
        """
        snap = self.snapshot(num_rows, width)
        (copy_fn or default_copy)(dst[:, :num_rows, :, :width], snap)
        return snap
