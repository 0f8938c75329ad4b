"""Batched decode-step updates: ``extend_many`` and ``commit_tokens_many`` of a whole batch.

A decode step grows every running request by one token and, after the model ran, commits
that token. Per-request calls cost a few microseconds of Python each; these do the same for a
whole batch with a handful of numpy operations over the request table's length arrays
(``kvplan.cache.request_table``), and run Python code only for the requests where something
happens:

* ``extend_many``: only requests whose new length crosses into a block they do not hold yet
  allocate (in batch order, exactly the blocks the per-request calls would get);
* ``commit_tokens_many``: only requests whose committed block just filled hash it (the same
  chained hash, offered to the prefix cache in batch order), and with
  ``release_out_of_window`` only requests with a newly dead window block free it (or, with
  ``release=False``, are returned so that the caller frees them with the manager's
  ``release_dead_blocks`` at the point of its own per-request loop where the per-request
  ``commit_tokens`` would have: the engine interleaves them with the finishes of the earlier
  rows, so the pools' free lists come out in the per-request order).

Both are equal to calling the per-request method for each request in order (tests hold them
equal on random operation sequences), with one difference on bad input: caller errors
(unknown or repeated ids, negative counts, too long sequences, committing past the logical
length or against the prompt) raise ``ValueError`` *before anything changes*, where the
per-request loop would have applied the calls before the bad one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvplan.cache.allocation_result import BatchAllocationResult
from kvplan.cache.block_allocator import BlockAllocator
from kvplan.cache.prefix_cache import PrefixCache
from kvplan.cache.request_table import RequestTable

_NONE = np.zeros(0, dtype=np.int64)  # no index (read-only by contract)


class DecodeStepUpdates:
    """``extend_many`` / ``commit_tokens_many`` over the manager's parts (see the module doc).

    Args:
        table: the request table (lengths, rows).
        allocator: allocates the new blocks and releases out-of-window ones.
        prefix_cache: hashes the blocks that fill.
        release_out_of_window: free dead window blocks as tokens are committed.
    """

    def __init__(
        self,
        table: RequestTable,
        allocator: BlockAllocator,
        prefix_cache: PrefixCache,
        release_out_of_window: bool,
    ) -> None:
        self.table = table
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.block_size = allocator.block_size
        self.max_blocks_per_seq = allocator.max_blocks_per_seq
        self.release_out_of_window = release_out_of_window
        self._unique_rows: np.ndarray | None = None  # the last batch checked for repeats

    def extend_many(
        self, request_ids: Sequence[Hashable], num_tokens: int | Sequence[int] | np.ndarray
    ) -> BatchAllocationResult:
        """``extend(request_ids[i], num_tokens[i])`` for i = 0, 1, ... up to the first request
        that cannot get its blocks.

        Args:
            request_ids: distinct active request ids, ``[n]``.
            num_tokens: tokens to add to each logical length: one int for all, or ``[n]`` ints
                (>= 0).

        Returns:
            `BatchAllocationResult`: requests ``[0, num_extended)`` grew (new blocks allocated
            in batch order, pool by pool, as ``extend`` allocates them); request
            ``num_extended`` and the later ones are unchanged, and ``failure`` is what
            ``extend`` returns for request ``num_extended`` (``ok`` when all grew).

        Example (block_size 4)::

            m.add_request("a", [1, 2, 3, 4])     # blocks [1]
            m.add_request("b", [5, 6])           # blocks [2]
            m.extend_many(["a", "b"], 1)         # a: 5 tokens -> [1, 3]; b: 3 tokens -> [2]
        """
        table = self.table
        ids, rows = self._distinct_rows(request_ids)
        n = rows.size
        counts = self._batch_counts("num_tokens", num_tokens, n)
        new_len = table.num_tokens[rows] + counts  # [n] int64
        want = (new_len + (self.block_size - 1)) // self.block_size  # blocks needed
        if n and int(want.max()) > self.max_blocks_per_seq:
            i = int(np.argmax(want > self.max_blocks_per_seq))
            raise ValueError(
                f"request {ids[i]!r}: num_tokens = {int(new_len[i])} tokens needs "
                f"{int(want[i])} blocks, more than max_blocks_per_seq = {self.max_blocks_per_seq}"
            )
        if table.num_multi_beam or self.allocator.has_gap(rows):
            # beams allocate per row, window gaps per column: the per-request path
            return self._extend_one_by_one(ids, rows, new_len)
        extra = want - table.num_allocated[rows]  # > 0: blocks to allocate
        needy = np.flatnonzero(extra > 0)
        num_ok, failure = n, None
        if needy.size:
            # every pool gives each request the same count: the first request whose running
            # total exceeds the smallest free count is the one the per-request loop stops at
            total = np.cumsum(extra[needy])
            free = self.allocator.min_free_blocks()
            k = int(np.searchsorted(total, free, side="right"))
            if k:
                self.allocator.append_blocks_many(rows[needy[:k]], extra[needy[:k]], total[:k])
            if k < needy.size:
                num_ok = int(needy[k])
                failure = self.allocator.shortfall([int(extra[num_ok])] * table.num_pools)
                assert failure is not None, "a request past the free blocks must fall short"
        table.num_tokens[rows[:num_ok]] = new_len[:num_ok]
        if failure is None:
            return BatchAllocationResult(n)
        return BatchAllocationResult(num_ok, failure)

    def commit_tokens_many(
        self,
        request_ids: Sequence[Hashable],
        token_ids: Sequence[int] | np.ndarray,
        *,
        release: bool = True,
    ) -> np.ndarray:
        """``commit_tokens(request_ids[i], [token_ids[i]])`` for every i: one token each.

        Args:
            request_ids: distinct active request ids, ``[n]``.
            token_ids: the token whose K/V was just written at each request's next committed
                position, ``[n]`` ints (a decode step's input tokens).
            release: free the window blocks that just left the window now (in batch order).
                False: leave them to the caller (module docstring).

        Returns:
            int64 ``[k]``, ascending: the indices ``i`` whose request still holds blocks that
            ``release_out_of_window`` frees (always empty with ``release=True`` or without
            ``release_out_of_window``).

        Raises:
            ValueError: a commit past a request's logical length, or a token at a prompt
                position that differs from the prompt (nothing is committed then).
        """
        table = self.table
        ids, rows = self._distinct_rows(request_ids)
        n = rows.size
        tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.shape != (n,):
            raise ValueError(f"token_ids has shape {tokens.shape}, expected ({n},)")
        start = table.num_committed[rows]  # [n] int64
        # past the logical length (an error) or at a prompt position (must equal the prompt)
        if ((start >= table.num_tokens[rows]) | (start < table.num_prompt[rows])).any():
            self._check_commits(ids, rows, start, tokens)
        bs = self.block_size
        offset = start % bs
        tail = table.tail
        tail[rows, offset] = tokens
        table.num_committed[rows] = start + 1
        for i in np.flatnonzero(offset == bs - 1).tolist():  # blocks that just filled
            req = table.get(ids[i])
            self.prefix_cache.block_filled(req, int(start[i]) // bs, tail[rows[i]])
        if not self.release_out_of_window:
            return _NONE
        dead = self.allocator.rows_with_dead_blocks(rows, start + 1)
        if not release:
            return dead
        for i in dead.tolist():
            self.allocator.release_out_of_window(table.get(ids[i]))
        return _NONE

    # ------------------------------------------------------------------ helpers
    def _extend_one_by_one(
        self, ids: Sequence[Hashable], rows: np.ndarray, new_len: np.ndarray
    ) -> BatchAllocationResult:
        """``extend`` request by request (beams allocate per row), lengths already checked."""
        for i in range(rows.size):
            total = int(new_len[i])
            result = self.allocator.grow_to(self.table.get(ids[i]), total, "num_tokens")
            if not result.ok:
                return BatchAllocationResult(i, result)
            self.table.num_tokens[rows[i]] = total
        return BatchAllocationResult(rows.size)

    def _distinct_rows(self, request_ids: Sequence[Hashable]) -> tuple[Sequence, np.ndarray]:
        """(indexable ids, their beam-0 rows ``[n]``); ValueError for unknown or repeated ids.

        ``RequestTable.seq_rows`` returns the same array object for the same batch as last time, so a
        decode loop checks a batch for repeats once, not every step.
        """
        ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
        rows = self.table.seq_rows(ids, None)
        if rows is not self._unique_rows:
            if np.unique(rows).size != rows.size:
                seen: set = set()
                dup = next(r for r in ids if r in seen or seen.add(r))
                raise ValueError(f"request_ids lists request {dup!r} more than once")
            self._unique_rows = rows
        return ids, rows

    def _check_commits(
        self, ids: Sequence[Hashable], rows: np.ndarray, start: np.ndarray, tokens: np.ndarray
    ) -> None:
        """ValueError for the first request committing past its logical length or a token
        that differs from its prompt (``commit_tokens``'s checks, one token per request)."""
        for i in range(rows.size):
            pos = int(start[i])
            if pos >= self.table.num_tokens[rows[i]]:
                raise ValueError(
                    f"request {ids[i]!r}: committing 1 token after {pos} exceeds the logical "
                    f"length {int(self.table.num_tokens[rows[i]])}"
                )
            prompt = self.table.get(ids[i]).prompt
            if pos < len(prompt) and prompt[pos] != tokens[i]:
                raise ValueError(
                    f"request {ids[i]!r}: committed tokens at [{pos}, {pos + 1}) differ from "
                    "the prompt"
                )

    @staticmethod
    def _batch_counts(name: str, counts, n: int) -> int | np.ndarray:
        """``counts`` checked: one int for all, or int64 ``[n]``; all >= 0."""
        if isinstance(counts, int):
            if counts < 0:
                raise ValueError(f"{name} must be >= 0, got {counts}")
            return counts
        arr = np.asarray(counts)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an int or ints, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if arr.ndim != 0 and arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}, expected () or ({n},)")
        if arr.size and int(arr.min()) < 0:
            i = int(np.argmin(arr)) if arr.ndim else 0
            raise ValueError(f"{name} must be >= 0, got {name}[{i}] = {int(arr.flat[i])}")
        return arr
