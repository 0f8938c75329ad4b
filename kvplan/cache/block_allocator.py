"""Blocks for table rows: the pools of every window size, kept in step over the request table.

Every pool gives a row the same number of blocks (a sequence has one table per pool, all of
the same length), so allocation asks each pool for the same count and fails, changing
nothing, when any pool is short. Out-of-window release is the one place where pools differ:
a window pool frees the leading blocks no future query can see and leaves block 0 in their
place (holes; the row's allocated count still includes them).

Windowed allocation (``windowed=True``, the manager's ``release_out_of_window``): a window
pool (window W) never allocates a block that no query can see. With ``c`` committed tokens a
row of window pool ``p`` holds real blocks exactly in columns ``[lo, hi)``, where
``lo = max(0, c - W + 1) // block_size`` (columns before it hold block 0, as release leaves
them) and ``hi`` is what the caller asked for so far (the prompt admits only the first chunk:
``allocate_prompt(..., end_tokens)``; ``materialize`` and ``grow_to`` extend it). Columns in
``[hi, num_allocated)`` hold block 0 until a later chunk asks for them (a *gap*; only
single-beam rows get one). Prefix hits: a match still needs the block in every pool (the
cached window block holds the same prefix); the window pool takes back only the hits at
columns ``>= lo`` and leaves the earlier ones on their free list.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvplan._math import cdiv
from kvplan.cache.allocation_result import ALLOCATED, AllocationResult
from kvplan.cache.block_pool import BlockPool
from kvplan.cache.request_table import Request, RequestTable


class BlockAllocator:
    """Allocate, release and free blocks of table rows across the pools.

    Args:
        pools: one ``BlockPool`` per window size.
        window_sizes: the window of each pool (None = full attention).
        table: the request table whose rows receive the blocks.
        block_size: tokens per block.
        max_blocks_per_seq: width of every table row.
        windowed: window pools allocate only the columns a query can see (module docstring).
    """

    def __init__(
        self,
        pools: list[BlockPool],
        window_sizes: Sequence[int | None],
        table: RequestTable,
        block_size: int,
        max_blocks_per_seq: int,
        *,
        windowed: bool = False,
    ) -> None:
        self.pools = pools
        self.windowed = windowed
        self.window_sizes = tuple(window_sizes)
        self.table = table
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq

    def num_blocks_for(self, name: str, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens fill; ValueError (naming ``name``) past
        ``max_blocks_per_seq``."""
        num_blocks = cdiv(num_tokens, self.block_size)
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(
                f"{name} = {num_tokens} tokens needs {num_blocks} blocks, more than "
                f"max_blocks_per_seq = {self.max_blocks_per_seq}"
            )
        return num_blocks

    def min_free_blocks(self) -> int:
        """The smallest free count over the pools (what a same-count allocation can take)."""
        return min(pool.num_free_blocks for pool in self.pools)

    def shortfall(self, need: Sequence[int]) -> AllocationResult | None:
        """The failed result when some pool ``p`` has fewer than ``need[p]`` free blocks,
        else None."""
        missing = tuple(max(0, n - p.num_free_blocks) for n, p in zip(need, self.pools))
        if any(missing):
            return AllocationResult(False, 0, max(missing), "blocks", missing)
        return None

    def _lazy(self, p: int) -> bool:
        return self.windowed and self.window_sizes[p] is not None

    def _first_live(self, p: int, committed: int) -> int:
        """Column ``lo`` of window pool ``p`` with ``committed`` tokens committed."""
        return max(0, committed - self.window_sizes[p] + 1) // self.block_size

    def _prompt_columns(
        self, p: int, num_prompt: int, num_hits: int, end_tokens: int
    ) -> tuple[int, int]:
        """Columns ``[lo, hi)`` of the prompt that pool ``p`` allocates at admission."""
        if not self._lazy(p):
            return 0, cdiv(num_prompt, self.block_size)
        lo = self._first_live(p, num_hits * self.block_size)
        return lo, cdiv(min(num_prompt, end_tokens), self.block_size)

    def prompt_shortfall(
        self,
        num_prompt: int,
        hit_blocks: list[list[int]],
        beam_width: int,
        num_cross: int,
        end_tokens: int | None = None,
    ) -> AllocationResult | None:
        """What ``allocate_prompt`` would miss (None when every pool has enough): per pool,
        the prompt's fresh full blocks, one partial block per beam, the encoder blocks, and
        the prefix hits that sit on the free list (taking them back uses up free blocks)."""
        num_full, has_tail = divmod(num_prompt, self.block_size)
        num_hits = len(hit_blocks)
        end = num_prompt if end_tokens is None or beam_width > 1 else end_tokens
        need = []
        for p, pool in enumerate(self.pools):
            lo, hi = self._prompt_columns(p, num_prompt, num_hits, end)
            used = {blocks[p] for blocks in hit_blocks[lo:]}
            num_free_hits = sum(pool.is_free(b) for b in used)
            fresh = max(0, min(num_full, hi) - max(lo, num_hits))
            tail = beam_width if has_tail and hi > num_full else 0
            need.append(fresh + tail + num_cross + num_free_hits)
        return self.shortfall(need)

    def allocate_prompt(
        self,
        req: Request,
        hit_blocks: list[list[int]],
        num_cross: int,
        end_tokens: int | None = None,
    ) -> None:
        """Give the fresh rows of ``req`` its prompt's blocks in every pool: the prefix hits
        ``hit_blocks[j][pool]`` and fresh full blocks shared by every beam (one reference
        per beam), a partial last block per beam, and ``num_cross`` encoder blocks. Windowed
        pools take only columns ``[lo, cdiv(end_tokens, block_size))`` (``end_tokens``:
        the end of the first chunk; ignored for beams). The caller checked
        ``prompt_shortfall`` with the same arguments."""
        num_prompt = len(req.prompt)
        num_full, has_tail = divmod(num_prompt, self.block_size)
        beam_width, table = req.beam_width, self.table
        num_hits = len(hit_blocks)
        end = num_prompt if end_tokens is None or beam_width > 1 else end_tokens
        for p, pool in enumerate(self.pools):
            lo, hi = self._prompt_columns(p, num_prompt, num_hits, end)
            hits = [blocks[p] for blocks in hit_blocks[lo:]]
            pool.touch(hits * beam_width)
            fresh = pool.allocate(max(0, min(num_full, hi) - max(lo, num_hits)))
            pool.touch(fresh * (beam_width - 1))
            shared = [0] * min(lo, num_hits) + hits + fresh
            shared += [0] * (num_full - len(shared))
            for beam in range(beam_width):
                tail = [] if not has_tail else pool.allocate(1) if hi > num_full else [0]
                table.set_blocks(p, req.rows[beam], shared + tail)
            if num_cross:
                table.set_cross_blocks(p, req.rows[0], pool.allocate(num_cross))

    def _gaps(self, req: Request, p: int, end_col: int) -> list[tuple[int, int]]:
        """``(row, column)`` of window pool ``p`` in ``[lo, end_col)`` still holding block 0."""
        lo = self._first_live(p, int(self.table.num_committed[req.rows[0]]))
        tables = self.table.tables
        return [
            (row, lo + int(c))
            for row in req.rows
            for c in np.flatnonzero(tables[p, row, lo:end_col] == 0)
        ]

    def materialize(self, req: Request, end_tokens: int) -> AllocationResult:
        """Give windowed pools real blocks for every column a query at positions
        ``< end_tokens`` (and ``>=`` the committed count) can see, up to the allocated
        count (no change and a failed result when a pool is short)."""
        if not self.windowed:
            return ALLOCATED
        end_col = min(cdiv(end_tokens, self.block_size), int(self.table.num_allocated[req.rows[0]]))
        gaps = [
            self._gaps(req, p, end_col) if self._lazy(p) else [] for p in range(len(self.pools))
        ]
        short = self.shortfall([len(g) for g in gaps])
        if short is not None:
            return short
        self._fill_gaps(gaps)
        return ALLOCATED

    def _fill_gaps(self, gaps: list[list[tuple[int, int]]]) -> None:
        """Give each ``(row, column)`` of ``gaps[p]`` a fresh block of pool ``p`` (the caller
        checked the pools hold them)."""
        tables = self.table.tables
        for p, (pool, pool_gaps) in enumerate(zip(self.pools, gaps)):
            for (row, col), block in zip(pool_gaps, pool.allocate(len(pool_gaps))):
                tables[p, row, col] = block

    def has_gap(self, rows: np.ndarray) -> bool:
        """Whether a windowed pool's last allocated column of some row in ``rows`` holds
        block 0 (a gap, or, conservatively, a released last block)."""
        if not self.windowed:
            return False
        last = np.maximum(self.table.num_allocated[rows].astype(np.int64) - 1, 0)
        tables = self.table.tables
        return any(
            bool((tables[p, rows, last] == 0).any())
            for p in range(len(self.pools))
            if self._lazy(p)
        )

    def grow_to(self, req: Request, total_tokens: int, name: str) -> AllocationResult:
        """Allocate blocks so that every beam of ``req`` holds ``total_tokens`` tokens, filling
        windowed gaps first (no change and a failed result when a pool is short)."""
        want = self.num_blocks_for(name, total_tokens)
        have = int(self.table.num_allocated[req.rows[0]])
        extra = max(0, want - have)
        gaps = [self._gaps(req, p, have) if self._lazy(p) else [] for p in range(len(self.pools))]
        if extra == 0 and not any(gaps):
            return ALLOCATED
        short = self.shortfall([extra * req.beam_width + len(g) for g in gaps])
        if short is not None:
            return short
        self._fill_gaps(gaps)
        if extra == 0:
            return ALLOCATED
        for row in req.rows:
            self.table.append_blocks(row, [pool.allocate(extra) for pool in self.pools])
        return ALLOCATED

    def append_blocks_many(self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> None:
        """Append ``counts[i]`` new blocks to table row ``rows[i]`` in every pool, taking them
        from each pool's free list in row order (what ``grow_to`` row by row does).

        ``rows``: distinct int64 ``[k]``; ``counts``: int64 ``[k]`` (>= 1); ``ends``: their
        inclusive prefix sums (block ``j`` of the allocation goes to the row whose range
        ``[ends[i] - counts[i], ends[i])`` holds ``j``). The caller checked that every pool
        has ``ends[-1]`` free blocks.
        """
        table = self.table
        num_new = int(ends[-1])
        have = table.num_allocated[rows]
        row_of = np.repeat(rows, counts)  # [num_new]
        col_of = np.arange(num_new) + np.repeat(have - (ends - counts), counts)
        tables = table.tables
        for p, pool in enumerate(self.pools):  # pools are independent: one call each
            tables[p, row_of, col_of] = pool.allocate(num_new)
        table.num_allocated[rows] = have + counts

    def truncate(self, req: Request, keep: int) -> None:
        """Cut every beam of ``req`` to ``keep`` blocks, freeing the rest (tail first, so
        cached prefixes stay cached longest; released holes are skipped)."""
        for row in req.rows:
            for pool, removed in zip(self.pools, self.table.truncate_blocks(row, keep)):
                pool.free([b for b in reversed(removed) if b])

    def free_cross(self, req: Request) -> None:
        """Free the request's encoder blocks."""
        for pool, cross in zip(self.pools, self.table.take_cross_blocks(req.rows[0])):
            pool.free(cross[::-1])

    def release_out_of_window(self, req: Request) -> None:
        """Free the leading blocks of window pools that no future query of ``req`` can see.

        Future queries sit at positions >= c = committed tokens and see keys >= p - W + 1, so
        block b is dead once its last position (b + 1) * bs - 1 < c - W + 1.
        """
        bs = self.block_size
        tables = self.table.tables
        committed = int(self.table.num_committed[req.rows[0]])
        for p, (pool, window) in enumerate(zip(self.pools, self.window_sizes)):
            if window is None:
                continue
            num_dead = max(0, committed - window + 1) // bs
            for row in req.rows:
                dead = tables[p, row, :num_dead]
                blocks = dead[dead != 0].tolist()
                if blocks:
                    pool.free(blocks[::-1])
                    dead[:] = 0

    def rows_with_dead_blocks(self, rows: np.ndarray, committed: np.ndarray) -> np.ndarray:
        """Indices ``i`` whose row ``rows[i]`` (``committed[i]`` tokens committed) still holds
        a block that ``release_out_of_window`` would free.

        Released blocks always form a prefix of a row (block 0 left in their place), so a
        row has something to free in window pool ``p`` iff its last dead column
        ``num_dead - 1`` still holds a block.
        """
        todo = np.zeros(rows.size, dtype=bool)
        tables = self.table.tables
        for p, window in enumerate(self.window_sizes):
            if window is None:
                continue
            num_dead = np.maximum(committed - (window - 1), 0) // self.block_size
            idx = np.flatnonzero(num_dead)
            todo[idx] |= tables[p, rows[idx], num_dead[idx] - 1] != 0
        return np.flatnonzero(todo)

    def beam_fork_copies(self, req: Request) -> list[tuple[int, int, int]]:
        """``(pool, src_block, dst_block)`` copies giving beams 1.. the prompt's partial block
        (the context step writes beam 0's copy only)."""
        num_prompt = len(req.prompt)
        if req.beam_width == 1 or num_prompt % self.block_size == 0:
            return []
        j = num_prompt // self.block_size
        tables = self.table.tables
        src_row = req.rows[0]
        return [
            (p, int(tables[p, src_row, j]), int(tables[p, row, j]))
            for p in range(len(self.pools))
            for row in req.rows[1:]
        ]
