"""Every read of the KV cache manager that the backends make, in one place.

The metadata never owns block tables between steps; each ``prepare()`` asks the manager for
the rows of this batch's sequences (``request_ids`` + beam expansion) through these helpers,
and then derives every kernel format from the same host table with numpy. That shared source
is why the three encodings (vanilla lists, ragged page table, block offsets) name the same
blocks by construction, and ``tests/backends`` checks it directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvplan.backends.host_arrays import ALL, MAX, MIN, SUM


def num_pools(manager: Any) -> int:
    """Number of block pools (one per distinct sliding-window size, VSWA)."""
    return int(manager.num_pools)


def pool_of_layer(manager: Any, layer_idx: int) -> int:
    """Pool holding layer ``layer_idx``'s blocks (``layer_to_pool``; pool 0 when unmapped)."""
    if manager is None:
        return 0
    return int(manager.pool_for_layer(layer_idx))


def batch_block_table(
    manager: Any,
    request_ids: list[int],
    *,
    pool: int,
    beam_width: int,
    num_contexts: int,
    cross: bool,
    width: int | None = None,
) -> np.ndarray:
    """Block table of the batch's sequences (host int32 ``[num_seqs, width]``).

    Args:
        width: table columns to fetch (default the manager's ``max_blocks_per_seq``); counts
            are only exact up to ``width``.

    Block 0 pads each row past its allocated blocks (reserved included). Context requests
    give one row (beam 0: they have not forked yet); generation requests give ``beam_width``
    rows (their beams' own rows, or for cross attention the request's single encoder row
    repeated, ``repeat_interleave``-style).
    """
    max_width = int(manager.max_blocks_per_seq)
    width = max_width if width is None else min(int(width), max_width)
    num_gen = len(request_ids) - num_contexts
    if cross:
        lists = [manager.get_cross_block_ids(rid, pool) for rid in request_ids]
        reps = [1] * num_contexts + [beam_width] * num_gen
        table = np.zeros((len(lists), width), np.int32)
        for i, ids in enumerate(lists):
            ids = ids[:width]
            table[i, : len(ids)] = ids
        table = np.repeat(table, reps, axis=0)
    elif beam_width == 1:
        table = manager.get_block_ids_per_seq(request_ids, pool, width=width)
    else:
        seq_ids = list(request_ids[:num_contexts])
        beams = [0] * num_contexts
        for rid in request_ids[num_contexts:]:
            seq_ids.extend([rid] * beam_width)
            beams.extend(range(beam_width))
        table = manager.get_block_ids_per_seq(seq_ids, pool, beams=beams, width=width)
    assert table.dtype == np.int32, f"the manager's block tables must be int32, got {table.dtype}"
    return table


def allocated_blocks(table: np.ndarray) -> np.ndarray:
    """Allocated blocks per row (int32): the manager never hands out block 0 and pads every
    row with it, so this is the count of nonzero entries (capped at the table width)."""
    return np.count_nonzero(table, axis=1).astype(np.int32)


def new_token_slots(
    table: np.ndarray, cached: np.ndarray, new_lens: np.ndarray, block_size: int
) -> np.ndarray:
    """Cache slot of every new K/V token, sequence by sequence (host, int32 ``[sum(new_lens)]``;
    slots fit in int32 because the manager checks ``num_blocks * block_size``).

    Token i of sequence b sits at position ``p = cached[b] + i`` and goes to slot
    ``table[b, p // block_size] * block_size + p % block_size``.

    Raises ValueError when a token would land past the table or in the padding block 0
    (the manager did not allocate a block for it).

    Example (block_size 4)::

        table = [[7, 3], [5, 0]], cached = [3, 0], new_lens = [2, 1]
        positions = [3, 4, 0]  ->  slots = [7*4+3, 3*4+0, 5*4+0] = [31, 12, 20]

    Work is per *run* (the new tokens of one sequence inside one block: slots are consecutive
    there), so a prefill chunk costs O(blocks) host operations plus two O(tokens) passes.
    """
    n = new_lens.size
    total = int(SUM(new_lens)) if n else 0
    if total == 0:
        return np.zeros(0, np.int32)
    bs = np.int32(block_size)
    start = cached if cached.dtype == np.int32 else cached.astype(np.int32)
    if total == n and MIN(new_lens) == 1:  # decode: one new token per sequence, one run each
        run_seq, run_col, lo, run_len = np.arange(n), start // bs, start, None
    else:
        end = start + (new_lens if new_lens.dtype == np.int32 else new_lens.astype(np.int32))
        first = start // bs
        runs = ((end - 1) // bs - first + 1) * (new_lens > 0)  # runs (blocks touched) per seq
        run_seq = np.arange(n, dtype=np.int32).repeat(runs)
        run_col = np.arange(run_seq.size, dtype=np.int32)
        run_col += (first - (runs.cumsum(dtype=np.int32) - runs)).repeat(runs)
        block_lo = run_col * bs
        lo = np.maximum(block_lo, start[run_seq])  # first position of each run
        run_len = np.minimum(block_lo + bs, end[run_seq]) - lo
    if int(MAX(run_col)) >= table.shape[1]:
        i = int(np.argmax(run_col))
        raise ValueError(
            f"sequence {int(run_seq[i])} writes position {(int(run_col[i]) + 1) * block_size - 1}"
            f" or below, past max_blocks_per_seq={table.shape[1]} blocks of {block_size}"
        )
    blocks = table[run_seq, run_col]
    if not ALL(blocks):
        bad = int(run_seq[np.argmin(blocks != 0)])
        raise ValueError(
            f"sequence {bad} writes a token into an unallocated block (block 0); allocate "
            "it with KVCacheManager.extend/reserve before prepare()"
        )
    first_slot = blocks * bs + lo % bs  # slot of each run's first token
    if run_len is None:
        return first_slot if first_slot.dtype == np.int32 else first_slot.astype(np.int32)
    # token k of the run starting at token offset o: first_slot + k = (first_slot - o) + index
    slots = (first_slot - (run_len.cumsum(dtype=np.int32) - run_len)).repeat(run_len)
    slots += np.arange(total, dtype=np.int32)
    return slots


def logical_num_blocks(kv_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Blocks that hold committed history: ``ceil(kv_lens / block_size)`` (int32)."""
    # kv_lens are int32 lengths far below 2^31 - block_size (checked against max_seq_len)
    return (kv_lens + np.int32(block_size - 1)) // np.int32(block_size)


def check_allocated(
    table: np.ndarray, num_needed: np.ndarray, what: str = "kv_lens"
) -> np.ndarray | None:
    """Every row of ``table`` must own its first ``num_needed[b]`` blocks.

    The manager fills a row's blocks from column 0 and pads with block 0, so it is enough
    that column ``num_needed[b] - 1`` is not the padding block (one gather, not a row scan).
    Returns that gathered last block of every row (int32 ``[n]``) when every row needs at
    least one block, else None; a decode step derives its slots from it
    (``decode_token_slots``).
    """
    n = num_needed.size
    if n == 0:
        return None
    if int(MAX(num_needed)) > table.shape[1]:
        b = int(np.argmax(num_needed))
        raise ValueError(
            f"sequence {b} needs {int(num_needed[b])} blocks for its {what}, more than the "
            f"{table.shape[1]} columns of its block table (max_blocks_per_seq)"
        )
    full = int(MIN(num_needed)) > 0
    if full:
        rows, last = np.arange(n), num_needed - 1
    else:
        rows = np.flatnonzero(num_needed > 0)
        last = num_needed[rows] - 1
    held = table[rows, last]
    if not ALL(held):
        b = int(rows[np.argmin(held != 0)])
        raise ValueError(
            f"sequence {b} needs {int(num_needed[b])} blocks for its {what} but the manager "
            "holds fewer"
        )
    return held if full else None


def decode_token_slots(last_blocks: np.ndarray, cached: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of a decode step's new tokens (one per sequence, at position ``cached[b]``).

    ``last_blocks[b]``: the block at column ``ceil((cached[b] + 1) / block_size) - 1`` of row
    b, i.e. the one ``check_allocated(table, logical_num_blocks(cached + 1, ...))`` returns,
    which is the block holding position ``cached[b]``. Equals ``new_token_slots(table,
    cached, ones, block_size)``; int32 ``[n]``.
    """
    bs = np.int32(block_size)
    return last_blocks * bs + cached % bs


def checked_token_slots(
    table: np.ndarray, num_needed: np.ndarray, cached: np.ndarray, seq_lens_kv: np.ndarray,
    block_size: int, decode: bool,
) -> np.ndarray:  # fmt: skip
    """``check_allocated(table, num_needed)``, then the new tokens' slots: from the gathered
    last blocks on a ``decode`` step (one new token per row), else ``new_token_slots``."""
    last_blocks = check_allocated(table, num_needed)
    if decode and last_blocks is not None:
        return decode_token_slots(last_blocks, cached, block_size)
    return new_token_slots(table, cached, seq_lens_kv, block_size)
