"""Which block-table rows a batch reads (seed 001 row rules), without copying any table.

``BatchRows.batch_tables`` (a ``KVCacheManager`` method) hands planning code a read-only view
of the manager's tables and the table row of every batch sequence; the attention backends
gather each kernel format from it straight into their staging buffers
(``kvplan.backends.ledger``). ``copy_batch_block_offsets`` uses the same row rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np


class BatchTables(NamedTuple):
    """A batch's rows of the manager's block tables, for planning code to gather from.

    ``tables``: int32 ``[num_pools, num_table_rows, max_blocks_per_seq]``, a read-only view of
    the manager's own tables (self or cross attention), valid until its next mutation; block 0
    past each row's allocated blocks. ``rows``: int64 ``[num_seqs]`` (read-only), the table row
    of each batch sequence, so sequence b's blocks in pool p are ``tables[p, rows[b]]``.
    ``num_allocated``: int32 ``[num_table_rows]`` (read-only view), blocks allocated per table
    row (logical + reserved, holes released out of the window included).
    """

    tables: np.ndarray
    rows: np.ndarray
    num_allocated: np.ndarray


def expand_batch_rows(
    rows_per_request: list[list[int]], beam_width: int, num_contexts: int, *, cross: bool
) -> np.ndarray:
    """Table rows of the batch's sequences in order (seed 001 row rules).

    Context requests contribute one row (beam 0: they have not forked yet). Generation
    requests contribute ``beam_width`` rows: their beams' own rows for self attention, or
    their single cross-attention row repeated ``beam_width`` times (all beams of a request
    read the same encoder K/V, like ``repeat_interleave``).

    Example: rows ``[[3], [4, 7], [5, 6]]``, beam_width 2, num_contexts 1 ->
    ``[3, 4, 7, 5, 6]`` (self) or ``[3, 4, 4, 5, 5]`` (cross).
    """
    out = [r[0] for r in rows_per_request[:num_contexts]]
    for rows in rows_per_request[num_contexts:]:
        if cross:
            out.extend([rows[0]] * beam_width)
        else:
            out.extend(rows[:beam_width])
    return np.asarray(out, dtype=np.int64)


def read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


class BatchRows:
    """The row rules of ``KVCacheManager`` (a mixin over its ``_tables``, ``_cross``,
    ``_num_allocated``, ``_num_cross``, ``_requests``, ``_num_multi_beam`` and ``_seq_rows``)."""

    def batch_tables(
        self,
        request_ids: Sequence[Hashable],
        beam_width: int = 1,
        num_contexts: int = 0,
        *,
        cross: bool = False,
    ) -> BatchTables:
        """The block-table rows of a batch's sequences (seed 001 row rules, see
        ``expand_batch_rows``) without copying any table: ``BatchTables(tables, rows)``.

        Example (one pool, beam_width 1)::

            bt = m.batch_tables(["a", "b"])
            bt.tables[0, bt.rows]              # [2, max_blocks_per_seq] block ids
        """
        rows = self._batch_rows(request_ids, beam_width, num_contexts, cross)
        tables, counts = (
            (self._cross, self._num_cross) if cross else (self._tables, self._num_allocated)
        )
        views = self.__dict__.setdefault("_read_only_views", {})
        hit = views.get(cross)
        if hit is None or hit[0] is not tables or hit[1] is not counts:
            # read-only views, made again only when the manager replaced an array (growth)
            hit = views[cross] = (tables, counts, read_only(tables), read_only(counts))
        return BatchTables(hit[2], rows, hit[3])

    def _batch_rows(
        self, request_ids: Sequence[Hashable], beam_width: int, num_contexts: int, cross: bool
    ) -> np.ndarray:
        """Table rows of the batch's sequences, int64 ``[num_seqs]`` (do not write it):
        context requests one row (beam 0), generation requests ``beam_width`` rows (cross:
        the request's encoder row repeated). Generation requests must have ``beam_width``
        beams whenever the batch or any active request has more than one."""
        if not 0 <= num_contexts <= len(request_ids):
            raise ValueError(f"num_contexts = {num_contexts} outside [0, {len(request_ids)}]")
        if beam_width == 1:
            seq_rows = self._seq_rows(request_ids, None)  # every row is a beam-0 row
        else:
            try:
                rows_of = [self._requests[r].rows for r in request_ids]
            except (KeyError, TypeError):
                for r in request_ids:
                    self._get(r)
                raise
            seq_rows = expand_batch_rows(rows_of, beam_width, num_contexts, cross=cross)
        # generation beams must match the batch (at beam 1 only while a multi-beam one exists)
        if not cross and (beam_width != 1 or self._num_multi_beam):
            for rid in request_ids[num_contexts:]:
                if self._requests[rid].beam_width != beam_width:
                    raise ValueError(
                        f"request {rid!r} has beam_width {self._requests[rid].beam_width}, "
                        f"the batch says {beam_width}"
                    )
        return seq_rows
