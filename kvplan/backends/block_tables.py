"""Host math over the KV cache manager's block tables: rows, slots, page lists, checks.

The metadata never owns block tables between steps; each ``prepare()`` asks the manager for
the rows of this batch's sequences (``KVCacheManager.batch_tables``, in
``PagedMetadata._step_rows``) and every kernel format is gathered from those same host tables
with the numpy helpers here, straight into the step's staging snapshot. That shared source
is why the three encodings (vanilla lists, ragged page table, block offsets) name the same
blocks by construction, and ``tests/backends`` checks it directly.

The helpers read block tables as ``TableRows``: a flat int32 table plus the flat offset where
each batch sequence's row starts. One form covers the manager's own table (``pool_rows``: row
b starts at ``rows[b] * width``, no gather needed), a gathered ``[n, width]`` table
(``table_rows``) and the K entries of a block-offset table (row b at ``b * 2 * width``).
All values are int32 block ids / slots / positions and int64 flat indices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from kvplan.backends.lengths import MAX, MIN
from kvplan.cache.batch_tables import BatchTables


class TableRows(NamedTuple):
    """Row b of a block table is ``flat[row_start[b] : row_start[b] + width]`` (int32 blocks;
    ``row_start``: int64 ``[>= num_seqs]``)."""

    flat: np.ndarray
    row_start: np.ndarray
    width: int


def pool_of_layer(manager: Any, layer_idx: int) -> int:
    """Pool holding layer ``layer_idx``'s blocks (``layer_to_pool``; pool 0 when unmapped)."""
    if manager is None:
        return 0
    return int(manager.pool_for_layer(layer_idx))


def gather_rows(
    bt: BatchTables,
    pool: int,
    out: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    width: int | None = None,
) -> np.ndarray:
    """Pool ``pool``'s rows of the batch: int32 ``[num_seqs, max_blocks_per_seq]`` (into
    ``out`` when given: a C-contiguous int32 array of that shape). ``rows`` replaces
    ``bt.rows`` (e.g. each row twice, for the K and V entries of a block-offset table);
    ``width`` keeps only each row's first ``width`` columns."""
    rows = bt.rows if rows is None else rows
    table = bt.tables[pool] if width is None else bt.tables[pool][:, :width]
    # mode="clip" skips numpy's buffered bounds check; the manager's rows are in range
    return table.take(rows, axis=0, out=out, mode="clip")


def pool_rows(bt: BatchTables, pool: int, row_start: np.ndarray) -> TableRows:
    """Pool ``pool``'s table read in place; ``row_start = bt.rows * max_blocks_per_seq``."""
    table = bt.tables[pool]  # [table_rows, width], C-contiguous
    return TableRows(table.reshape(-1), row_start, table.shape[1])


def table_rows(table: np.ndarray) -> TableRows:
    """A gathered ``[n, width]`` block table as ``TableRows``."""
    n, width = table.shape
    return TableRows(table.reshape(-1), np.arange(n, dtype=np.int64) * width, width)


def flat_page_index(
    row_start: np.ndarray, indptr: np.ndarray, num_blocks: np.ndarray, arange: np.ndarray
) -> np.ndarray:
    """Flat table index of every page of a ragged page table (int64 ``[indptr[n]]``):
    page ``j`` of sequence b (``indptr[b] <= j < indptr[b + 1]``) is column ``j - indptr[b]``
    of its row, i.e. ``flat[row_start[b] - indptr[b] + j]``. ``arange``: int
    ``[>= indptr[n]]`` holding 0, 1, ... (precomputed by the caller).

    Example: row_start = [96, 0], num_blocks = [2, 3], indptr = [0, 2, 5]
    -> [96, 97, 0, 1, 2].
    """
    n = num_blocks.size
    index = (row_start[:n] - indptr[:n]).repeat(num_blocks)
    index += arange[: index.size]
    return index


@functools.cache
def _block_math(block_size: int) -> tuple[np.int32, np.int32, np.int32 | None]:
    """``(block_size, block_size - 1, log2(block_size) or None)`` as int32 scalars, made once
    per block size (building a numpy scalar costs more than the op on a step's arrays)."""
    pow2 = block_size & (block_size - 1) == 0
    shift = np.int32(block_size.bit_length() - 1) if pow2 else None
    return np.int32(block_size), np.int32(block_size - 1), shift


def block_column(positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions // block_size, positions % block_size)`` (int32, like ``positions``): the
    block column of each position and its offset in that block (a shift and a mask when
    ``block_size`` is a power of two)."""
    bs, mask, shift = _block_math(block_size)
    if shift is not None:
        return positions >> shift, positions & mask
    return positions // bs, positions % bs


def new_token_positions(
    cached: np.ndarray, cu_new: np.ndarray, new_lens: np.ndarray, arange: np.ndarray
) -> np.ndarray:
    """Absolute position of every new K/V token, sequence by sequence (int32 ``[T]``,
    ``T = cu_new[n]``): token i of sequence b is at ``cached[b] + i``. ``cu_new``: int32
    ``[n + 1]`` exclusive prefix sum of ``new_lens``; ``arange``: int32 ``0, 1, ...`` of at
    least ``T`` entries. Example: cached = [3, 0], new_lens = [2, 1] -> [3, 4, 0]."""
    n = new_lens.size
    positions = (cached - cu_new[:n]).repeat(new_lens)
    positions += arange[: positions.size]
    return positions


def new_token_slots(
    rows: TableRows,
    cached: np.ndarray,
    new_lens: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """Cache slot of every new K/V token, sequence by sequence (host, int32 ``[sum(new_lens)]``;
    slots fit in int32 because the manager checks ``num_blocks * block_size``).

    Token i of sequence b sits at position ``p = cached[b] + i`` and goes to slot
    ``table[b, p // block_size] * block_size + p % block_size``. ``cached`` and ``new_lens``:
    int32 ``[n]``.

    Raises ValueError when a token would land past the table or in the padding block 0 (the
    manager did not allocate a block for it).

    Example (block_size 4)::

        table = [[7, 3], [5, 0]], cached = [3, 0], new_lens = [2, 1]
        positions = [3, 4, 0]  ->  slots = [7*4+3, 3*4+0, 5*4+0] = [31, 12, 20]

    Work is per token (``new_token_positions``, ``block_column``, one gather of the blocks
    from the flat table, ``token_slots``): a handful of numpy passes, no per-row Python.
    """
    n = new_lens.size
    cu = np.zeros(n + 1, np.int32)
    new_lens.cumsum(out=cu[1:])
    total = int(cu[n])
    if total == 0:
        return np.zeros(0, np.int32)
    positions = new_token_positions(cached, cu, new_lens, np.arange(total, dtype=np.int32))
    column, in_block = block_column(positions, block_size)
    if int(MAX(column)) >= rows.width:
        i = int(np.argmax(column))
        raise ValueError(
            f"sequence {int(np.searchsorted(cu, i, 'right')) - 1} writes position "
            f"{int(positions[i])}, past max_blocks_per_seq={rows.width} blocks of {block_size}"
        )
    index = rows.row_start[:n].repeat(new_lens)
    index += column
    blocks = rows.flat.take(index)
    if not MIN(blocks):  # block ids are >= 0: the minimum is 0 iff one is
        i = int(np.argmin(blocks != 0))
        raise ValueError(
            f"sequence {int(np.searchsorted(cu, i, 'right')) - 1} writes a token into an "
            "unallocated block (block 0); allocate it with KVCacheManager.extend/reserve "
            "before prepare()"
        )
    return token_slots(blocks, in_block, block_size)


def token_slots(
    blocks: np.ndarray, in_block: np.ndarray, block_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """``blocks * block_size + in_block``: the slots of tokens in ``blocks`` (int32 ``[T]``)
    at offsets ``in_block`` (int32 ``[T]``); into ``out`` (int32 or int64 ``[T]``) when given."""
    out = np.multiply(blocks, np.int32(block_size), out=out)
    out += in_block
    return out


def logical_num_blocks(kv_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Blocks that hold committed history: ``ceil(kv_lens / block_size)`` (int32)."""
    # kv_lens are int32 lengths far below 2^31 - block_size (checked against max_seq_len)
    bs, bs_minus1, shift = _block_math(block_size)
    out = kv_lens + bs_minus1
    if shift is not None:  # a shift: cheaper than numpy's integer division
        out >>= shift
    else:
        out //= bs
    return out


def last_needed_blocks(
    rows: TableRows,
    num_needed: np.ndarray,
    what: str = "kv_lens",
    *,
    max_needed: int | None = None,
    check_only: bool = False,
    index: np.ndarray | None = None,
) -> np.ndarray | None:
    """Every row must own its first ``num_needed[b]`` blocks; returns the last of them.

    The manager fills a row's blocks from column 0 and pads with block 0, so it is enough
    that column ``num_needed[b] - 1`` is not the padding block (one gather, not a row scan).
    Returns that last block of every row (int32 ``[n]``) when every row needs at least one
    block, else None; a decode step derives its slots from it (``decode_token_slots``).
    ``max_needed``: ``max(num_needed)`` when the caller knows it; ``check_only``: only check
    (returns None); ``index``: the flat table index ``row_start[:n] + num_needed - 1`` when
    the caller has it (shared by the pools). Raises ValueError naming the row otherwise.
    """
    n = num_needed.size
    if n == 0:
        return None
    if max_needed is None:
        max_needed = int(MAX(num_needed))
    if max_needed > rows.width:
        b = int(np.argmax(num_needed))
        raise ValueError(
            f"sequence {b} needs {int(num_needed[b])} blocks for its {what}, more than the "
            f"{rows.width} columns of its block table (max_blocks_per_seq)"
        )
    # One gather for every row: a row that needs no block reads column -1 of its row (the
    # previous row's last entry, or entry 0 after the clip), which can only make the minimum
    # 0; the exact per-row check below runs only then.
    if index is None:
        index = rows.row_start[:n] + (num_needed - 1)
    held = rows.flat.take(index, mode="clip")
    if not MIN(held):  # block ids are >= 0 (int MIN: cheaper than a bool all())
        which = np.flatnonzero(num_needed > 0)
        bad = which[rows.flat.take(rows.row_start[which] + (num_needed[which] - 1)) == 0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"sequence {b} needs {int(num_needed[b])} blocks for its {what} but the "
                "manager holds fewer"
            )
    if check_only or int(MIN(num_needed)) <= 0:
        return None
    return held


def decode_last_blocks(
    rows: TableRows,
    column: np.ndarray,
    max_column: int,
    what: str = "kv_lens",
    index: np.ndarray | None = None,
) -> np.ndarray:
    """``last_needed_blocks`` of a decode step, whose rows need ``column + 1`` blocks: the
    block at ``column[b]`` (int32 ``[n]``) of every row, after checking that it exists.
    ``max_column``: ``max(column)`` (from the step's longest sequence); ``index``: the flat
    table index ``row_start[:n] + column`` when the caller has it (shared by the pools)."""
    if max_column >= rows.width:
        b = int(np.argmax(column))
        raise ValueError(
            f"sequence {b} needs {int(column[b]) + 1} blocks for its {what}, more than the "
            f"{rows.width} columns of its block table (max_blocks_per_seq)"
        )
    if index is None:
        index = rows.row_start[: column.size] + column
    held = rows.flat.take(index)
    if held.size and not MIN(held):  # block ids are >= 0: the minimum is 0 iff one is
        b = int(np.argmin(held != 0))
        raise ValueError(
            f"sequence {b} needs {int(column[b]) + 1} blocks for its {what} but the manager "
            "holds fewer"
        )
    return held


def check_allocated(
    table: np.ndarray, num_needed: np.ndarray, what: str = "kv_lens"
) -> np.ndarray | None:
    """``last_needed_blocks`` of a gathered ``[n, width]`` block table."""
    return last_needed_blocks(table_rows(table), num_needed, what)


def decode_token_slots(last_blocks: np.ndarray, cached: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of a decode step's new tokens (one per sequence, at position ``cached[b]``).

    ``last_blocks[b]``: the block at column ``ceil((cached[b] + 1) / block_size) - 1`` of row
    b, i.e. the one ``check_allocated(table, logical_num_blocks(cached + 1, ...))`` returns,
    which is the block holding position ``cached[b]``. Equals ``new_token_slots(table,
    cached, ones, block_size)``; int32 ``[n]``.
    """
    return token_slots(last_blocks, block_column(cached, block_size)[1], block_size)


class StepRows(NamedTuple):
    """One step's validated view of the batch's block tables (``PagedMetadata._step_rows``).

    ``tables``: the manager's rows (``BatchTables``); ``pools``: each pool's ``TableRows``
    (all with the same ``row_start``); ``num_needed``: int32 ``[n]`` blocks each row owns
    (checked). Per new K/V token (``[T]``, sequence by sequence): ``index`` (int64) the flat
    table index of its block, ``in_block`` (int32) its offset in that block, ``positions``
    (int32) its absolute position. A decode step (one new token per row, ``T = n``) also keeps
    each pool's block of the new token (``last_blocks``, gathered by the check); otherwise
    ``last_blocks`` is None and ``write_slots`` gathers them.
    """

    tables: BatchTables
    pools: list[TableRows]
    num_needed: np.ndarray
    index: np.ndarray | None
    in_block: np.ndarray | None
    positions: np.ndarray | None
    last_blocks: list[np.ndarray] | None

    def write_slots(self, pool: int, block_size: int, out: np.ndarray) -> None:
        """Pool ``pool``'s new-token slots into ``out`` (int32 or int64 ``[T]``)."""
        if self.last_blocks is None:  # in range: the step's rows own these blocks (checked)
            blocks = self.pools[pool].flat.take(self.index, mode="clip")
        else:
            blocks = self.last_blocks[pool]
        token_slots(blocks, self.in_block, block_size, out)


class PerBatch:
    """``fn(rows)`` of the batch's table rows, recomputed only when the manager hands out a
    different ``rows`` array (it returns the same read-only array while the batch stays).

    Example: ``row_starts = PerBatch(lambda rows: rows * width)``, then
    ``pool_rows(bt, p, row_starts(bt.rows))`` every step.
    """

    def __init__(self, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        self.fn = fn
        self._rows: np.ndarray | None = None
        self._value = np.zeros(0, np.int64)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        if rows is not self._rows:
            self._value = self.fn(rows)
            self._rows = rows  # held, so its id cannot be reused while cached
        return self._value
