"""Block tables -> the batch formats kernels read, and the staging rule for async copies.

The manager keeps, per pool, a table ``tables[pool, row, j]`` (int32) = the j-th block of the
sequence stored in ``row`` (one row per (request, beam)), zero past the row's allocated count,
so padding is block 0 for free. This module turns a batch of rows into:

* ``per_seq_table``   -- ``[n, width]`` int32, padded with block 0;
* ``flat_block_ids``  -- the rows' first ``num_blocks[i]`` entries concatenated (ragged page
  table indices);
* ``BatchViews`` -- the manager's batch methods built on these (``get_block_ids_per_seq``,
  ``get_batch_cache_indices[_flat]``, ``copy_batch_block_offsets``), and, from
  ``kvplan.cache.batch_tables``, ``batch_tables``: a read-only view of the tables plus the
  batch's row numbers, from which the attention backends gather every format straight into
  their staging buffers;
* ``BlockOffsetsStager`` -- the 4-D block-offset table ``[num_pools, max_batch, 2,
  max_blocks_per_seq]`` (index 0 of dim 2 = K, 1 = V). K and V live in separate tensors indexed
  by the same block id, so both entries hold the block id itself.

Staging rule (seed 001): the persistent host buffer ``host_block_offsets`` is filled in place
and stays for synchronous CPU readers (it keeps ``max_batch`` rows across calls); every async
host-to-device copy reads a *private* pinned snapshot of the rows it needs. Reusing the
persistent buffer as the copy source is a hazard: when the CPU runs one step ahead it refills
the buffer before the previous step's queued copy has executed, and the kernel then reads
the next batch's blocks. ``tests/cache/test_block_offsets.py`` shows that hazard and its fix.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from kvplan._checks import check_tensor
from kvplan.cache.batch_tables import BatchRows, BatchTables, expand_batch_rows

__all__ = [
    "BatchTables",
    "BatchViews",
    "BlockOffsetsStager",
    "expand_batch_rows",
    "flat_block_ids",
    "per_seq_table",
]

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def per_seq_table(table: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
    """``table[rows, :width]`` as a fresh C-contiguous int32 array ``[len(rows), width]``.

    (Advanced indexing on the leading axis always builds a new C-ordered array, so no
    ``ascontiguousarray`` call is needed; ``test_block_offsets`` checks the flags.)"""
    return table[rows, :width]


def flat_block_ids(table: np.ndarray, rows: np.ndarray, num_blocks: np.ndarray) -> np.ndarray:
    """Concatenate ``table[rows[i], :num_blocks[i]]`` over i into one int32 array.

    Example::

        table = [[5, 6, 7, 0],        rows = [1, 0], num_blocks = [1, 3]
                 [9, 8, 0, 0]]   ->   [9, 5, 6, 7]
    """
    if rows.size == 0:
        return np.zeros(0, dtype=np.int32)
    width = int(num_blocks.max())
    sub = table[rows, :width]  # [n, width]
    mask = np.arange(width, dtype=np.int64)[None, :] < num_blocks[:, None]
    return sub[mask]


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


class BatchViews(BatchRows):
    """Batch block tables and block offsets of ``KVCacheManager`` (a mixin over its tables:
    ``_tables``, ``_cross``, ``_num_allocated``, ``_num_cross``, ``_requests``, ``_stagers``)."""

    def get_block_ids_per_seq(
        self,
        request_ids: Sequence[Hashable],
        pool: int = 0,
        *,
        beams: Sequence[int] | None = None,
        width: int | None = None,
    ) -> np.ndarray:
        """Block tables ``[n, width]`` int32 (width defaults to max_blocks_per_seq), padded
        with block 0. ``beams[i]`` (default 0) picks the beam of ``request_ids[i]``."""
        rows = self._seq_rows(request_ids, beams)
        width = self.max_blocks_per_seq if width is None else width
        if not 0 <= width <= self.max_blocks_per_seq:
            raise ValueError(f"width = {width} outside [0, {self.max_blocks_per_seq}]")
        return per_seq_table(self._tables[self._check_pool(pool)], rows, width)

    def get_batch_cache_indices(
        self,
        request_ids: Sequence[Hashable],
        layer_idx: int | None = None,
        num_blocks_per_seq: Sequence[int] | None = None,
        *,
        beams: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Per-sequence block-id lists of ``layer_idx``'s pool (all allocated blocks, or the
        first ``num_blocks_per_seq[i]`` of each)."""
        rows = self._seq_rows(request_ids, beams)
        counts = self._counts(rows, num_blocks_per_seq)
        table = self._tables[self.pool_for_layer(layer_idx)]
        return [table[r, :c].tolist() for r, c in zip(rows.tolist(), counts.tolist())]

    def get_batch_cache_indices_flat(
        self,
        request_ids: Sequence[Hashable],
        num_blocks_per_seq: Sequence[int] | None = None,
        layer_idx: int | None = None,
        *,
        beams: Sequence[int] | None = None,
    ) -> np.ndarray:
        """``get_batch_cache_indices`` concatenated into one int32 array (ragged indices)."""
        rows = self._seq_rows(request_ids, beams)
        counts = self._counts(rows, num_blocks_per_seq)
        return flat_block_ids(self._tables[self.pool_for_layer(layer_idx)], rows, counts)

    def _counts(self, rows: np.ndarray, num_blocks_per_seq) -> np.ndarray:
        allocated = self._num_allocated[rows]
        if num_blocks_per_seq is None:
            return allocated
        counts = np.asarray(num_blocks_per_seq, dtype=np.int32).reshape(-1)
        if counts.shape != rows.shape:
            raise ValueError(
                f"num_blocks_per_seq has {counts.size} entries for {rows.size} sequences"
            )
        bad = np.flatnonzero((counts < 0) | (counts > allocated))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"num_blocks_per_seq[{i}] = {int(counts[i])} outside [0, {int(allocated[i])}] "
                "(allocated blocks)"
            )
        return counts

    def fill_host_block_offsets(
        self,
        request_ids: Sequence[Hashable],
        beam_width: int,
        num_contexts: int,
        num_seqs: int,
        *,
        max_batch: int,
        cross: bool = False,
    ):
        """Fill the persistent host buffer ``[num_pools, max_batch, 2, max_blocks_per_seq]``
        for this batch and return its stager (``.host_block_offsets`` is the buffer)."""
        num_gen = len(request_ids) - num_contexts
        if not 0 <= num_contexts <= len(request_ids):
            raise ValueError(f"num_contexts = {num_contexts} outside [0, {len(request_ids)}]")
        expected = num_contexts + num_gen * beam_width
        if num_seqs != expected:
            raise ValueError(
                f"{'cross ' if cross else ''}block offsets expect {expected} rows "
                f"({num_contexts} context + {num_gen} x beam {beam_width}), got num_seqs = {num_seqs}"
            )
        seq_rows = self._batch_rows(request_ids, beam_width, num_contexts, cross)
        key = (cross, max_batch)
        stager = self._stagers.get(key)
        if stager is None:
            stager = BlockOffsetsStager(self.num_pools, max_batch, self.max_blocks_per_seq)
            self._stagers[key] = stager
        tables, counts = (
            (self._cross, self._num_cross) if cross else (self._tables, self._num_allocated)
        )
        stager.fill(tables, seq_rows, counts)
        return stager

    def copy_batch_block_offsets(
        self,
        dst,
        request_ids: Sequence[Hashable],
        beam_width: int,
        num_contexts: int,
        num_seqs: int,
        *,
        cross: bool = False,
        max_blocks: int | None = None,
        copy_fn: CopyFn | None = None,
    ):
        """Write this batch's block-offset rows into ``dst`` (seed 001 rules, staging rule).

        ``dst``: int32 ``[num_pools, max_batch, 2, max_blocks_per_seq]`` (any device). Rows
        ``[0, num_seqs)``: context requests one row each, generation requests ``beam_width``
        rows each (cross: the request's encoder row repeated). ``max_blocks`` caps the copied
        width (only valid when nothing advances lengths on the device); None copies the full
        width. The persistent host buffer is refilled in place; the copy reads a private pinned
        snapshot (returned). ``copy_fn(dst_view, src)`` defaults to a non_blocking copy_.
        """
        check_block_offsets_dst(dst, self.num_pools, self.max_blocks_per_seq, num_seqs)
        stager = self.fill_host_block_offsets(
            request_ids, beam_width, num_contexts, num_seqs, max_batch=dst.shape[1], cross=cross
        )
        width = self.max_blocks_per_seq
        if max_blocks is not None:
            width = min(max(int(max_blocks), 1), self.max_blocks_per_seq)
        return stager.copy_to(dst, num_seqs, width, copy_fn)  # dst checked above

    def host_block_offsets(self, max_batch: int, *, cross: bool = False):
        """The persistent host buffer of ``(cross, max_batch)`` (for synchronous readers)."""
        stager = self._stagers.get((cross, max_batch))
        if stager is None:
            raise ValueError(f"no block offsets were filled for max_batch = {max_batch}")
        return stager.host_block_offsets
