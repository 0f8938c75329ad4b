"""A batch's view of the request table: block tables, cache indices and block offsets.

``BatchTableViews`` answers the manager's batch queries from the request table's arrays
without changing them: which table rows a batch reads (the row rules of
``expand_batch_rows``), the padded and ragged block-table formats (``batch_tables``), and the
block-offset table staged for an async copy (``block_offsets``, one stager per
``(cross, max_batch)``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvplan.cache.batch_tables import (
    BatchTables,
    expand_batch_rows,
    flat_block_ids,
    per_seq_table,
    read_only,
)
from kvplan.cache.block_offsets import BlockOffsetsStager, CopyFn, check_block_offsets_dst
from kvplan.cache.request_table import RequestTable


class BatchTableViews:
    """Batch block tables and block offsets over a request table.

    Args:
        table: the request table to read.
        max_blocks_per_seq: width of every table row.
    """

    def __init__(self, table: RequestTable, max_blocks_per_seq: int) -> None:
        self.table = table
        self.max_blocks_per_seq = max_blocks_per_seq
        self._stagers: dict[tuple[bool, int], BlockOffsetsStager] = {}
        # cross -> (tables, counts, their read-only views), remade when the table grows
        self._read_only: dict[bool, tuple] = {}

    def batch_rows(
        self, request_ids: Sequence[Hashable], beam_width: int, num_contexts: int, cross: bool
    ) -> np.ndarray:
        """Table rows of the batch's sequences, int64 ``[num_seqs]`` (do not write it):
        context requests one row (beam 0), generation requests ``beam_width`` rows (cross:
        the request's encoder row repeated). Generation requests must have ``beam_width``
        beams whenever the batch or any active request has more than one."""
        if not 0 <= num_contexts <= len(request_ids):
            raise ValueError(f"num_contexts = {num_contexts} outside [0, {len(request_ids)}]")
        table = self.table
        if beam_width == 1:
            seq_rows = table.seq_rows(request_ids, None)  # every row is a beam-0 row
        else:
            rows_of = [table.get(r).rows for r in request_ids]
            seq_rows = expand_batch_rows(rows_of, beam_width, num_contexts, cross=cross)
        # generation beams must match the batch (at beam 1 only while a multi-beam one exists)
        if not cross and (beam_width != 1 or table.num_multi_beam):
            for rid in request_ids[num_contexts:]:
                width = table.get(rid).beam_width
                if width != beam_width:
                    raise ValueError(
                        f"request {rid!r} has beam_width {width}, the batch says {beam_width}"
                    )
        return seq_rows

    def batch_tables(
        self,
        request_ids: Sequence[Hashable],
        beam_width: int = 1,
        num_contexts: int = 0,
        *,
        cross: bool = False,
    ) -> BatchTables:
        """The block-table rows of a batch's sequences (see ``batch_rows``) without copying
        any table: ``BatchTables(tables, rows, num_allocated)``, read-only views."""
        rows = self.batch_rows(request_ids, beam_width, num_contexts, cross)
        tables, counts = self._arrays(cross)
        hit = self._read_only.get(cross)
        if hit is None or hit[0] is not tables or hit[1] is not counts:
            # read-only views, made again only when the table replaced an array (growth)
            hit = self._read_only[cross] = (tables, counts, read_only(tables), read_only(counts))
        return BatchTables(hit[2], rows, hit[3])

    def get_block_ids_per_seq(
        self,
        request_ids: Sequence[Hashable],
        pool: int,
        beams: Sequence[int] | None,
        width: int | None,
    ) -> np.ndarray:
        """Block tables ``[n, width]`` int32 of ``pool`` (width defaults to
        max_blocks_per_seq), padded with block 0."""
        rows = self.table.seq_rows(request_ids, beams)
        width = self.max_blocks_per_seq if width is None else width
        if not 0 <= width <= self.max_blocks_per_seq:
            raise ValueError(f"width = {width} outside [0, {self.max_blocks_per_seq}]")
        return per_seq_table(self.table.tables[self.table.check_pool(pool)], rows, width)

    def get_batch_cache_indices(
        self,
        request_ids: Sequence[Hashable],
        pool: int,
        num_blocks_per_seq: Sequence[int] | None,
        beams: Sequence[int] | None,
    ) -> list[list[int]]:
        """Per-sequence block-id lists of ``pool`` (all allocated blocks, or the first
        ``num_blocks_per_seq[i]`` of each)."""
        rows = self.table.seq_rows(request_ids, beams)
        counts = self._counts(rows, num_blocks_per_seq)
        table = self.table.tables[pool]
        return [table[r, :c].tolist() for r, c in zip(rows.tolist(), counts.tolist())]

    def get_batch_cache_indices_flat(
        self,
        request_ids: Sequence[Hashable],
        pool: int,
        num_blocks_per_seq: Sequence[int] | None,
        beams: Sequence[int] | None,
    ) -> np.ndarray:
        """``get_batch_cache_indices`` concatenated into one int32 array (ragged indices)."""
        rows = self.table.seq_rows(request_ids, beams)
        counts = self._counts(rows, num_blocks_per_seq)
        return flat_block_ids(self.table.tables[pool], rows, counts)

    def fill_host_block_offsets(
        self,
        request_ids: Sequence[Hashable],
        beam_width: int,
        num_contexts: int,
        num_seqs: int,
        *,
        max_batch: int,
        cross: bool = False,
    ) -> BlockOffsetsStager:
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
        seq_rows = self.batch_rows(request_ids, beam_width, num_contexts, cross)
        key = (cross, max_batch)
        stager = self._stagers.get(key)
        if stager is None:
            stager = BlockOffsetsStager(self.table.num_pools, max_batch, self.max_blocks_per_seq)
            self._stagers[key] = stager
        tables, counts = self._arrays(cross)
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
        """Write this batch's block-offset rows into ``dst`` (row rules, staging rule).

        ``dst``: int32 ``[num_pools, max_batch, 2, max_blocks_per_seq]`` (any device). Rows
        ``[0, num_seqs)``: context requests one row each, generation requests ``beam_width``
        rows each (cross: the request's encoder row repeated). ``max_blocks`` caps the copied
        width (only valid when nothing advances lengths on the device); None copies the full
        width. The persistent host buffer is refilled in place; the copy reads a private pinned
        snapshot (returned). ``copy_fn(dst_view, src)`` defaults to a non_blocking copy_.
        """
        check_block_offsets_dst(dst, self.table.num_pools, self.max_blocks_per_seq, num_seqs)
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

    # ------------------------------------------------------------------ helpers
    def _arrays(self, cross: bool) -> tuple[np.ndarray, np.ndarray]:
        """(tables, allocated counts per row) of self or cross attention."""
        t = self.table
        return (t.cross, t.num_cross) if cross else (t.tables, t.num_allocated)

    def _counts(self, rows: np.ndarray, num_blocks_per_seq) -> np.ndarray:
        allocated = self.table.num_allocated[rows]
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
