"""Block tables -> the batch formats kernels read, and which table rows a batch reads.

The manager keeps, per pool, a table ``tables[pool, row, j]`` (int32) = the j-th block of the
sequence stored in ``row`` (one row per (request, beam)), zero past the row's allocated count,
so padding is block 0 for free. Numpy only:

* ``expand_batch_rows`` -- the table rows of a batch's sequences (the row rules below);
* ``BatchTables`` -- a read-only view of the tables plus a batch's row numbers, from which
  the attention backends gather every kernel format straight into their staging buffers;
* ``per_seq_table``   -- ``[n, width]`` int32, padded with block 0;
* ``flat_block_ids``  -- the rows' first ``num_blocks[i]`` entries concatenated (ragged page
  table indices).
"""

from __future__ import annotations

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
    """Table rows of the batch's sequences in order (the row rules).

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
