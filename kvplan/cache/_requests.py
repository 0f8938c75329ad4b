"""Per-request state and the numpy block tables behind ``KVCacheManager``.

Each (request, beam) owns one *row*; ``tables[pool, row, j]`` is the row's j-th block (0 past
its allocated count, so padding is block 0), ``num_allocated[row]`` its allocated count (equal
in every pool). A request's cross-attention (encoder) blocks live in ``cross[pool, row0, :]``
with ``row0`` its beam-0 row. Rows are recycled; the tables grow by doubling.

The per-request lengths are numpy arrays indexed by ``row0`` too, so that a decode step can
update a whole batch with a few numpy operations (``_batched.py``):

* ``num_tokens[row0]``: the logical length; ``num_prompt[row0]``: ``len(prompt)``;
* ``num_committed[row0]``: committed tokens;
* ``tail[row0, :]``: the committed tokens of the last, partly committed block (int64
  ``[block_size]``; entry ``i`` is position ``(num_committed // block_size) * block_size + i``).
  Tokens of full committed blocks are not kept: a full block is hashed the moment it fills
  (the chain ``Request.hashes`` always covers every hashable full block), so nothing reads
  them again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Request:
    prompt: list[int]
    beam_width: int
    rows: list[int]
    num_encoder_tokens: int
    cacheable: bool
    state_slot: int | None
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks 0, 1, ..


class RequestTable:
    """Rows, block tables, state slots and the request-id -> state map."""

    _INITIAL_ROWS = 64

    def __init__(
        self, num_pools: int, max_blocks_per_seq: int, num_state_slots: int, block_size: int
    ) -> None:
        rows = self._INITIAL_ROWS
        self._tables = np.zeros((num_pools, rows, max_blocks_per_seq), dtype=np.int32)
        self._cross = np.zeros((num_pools, rows, max_blocks_per_seq), dtype=np.int32)
        self._num_allocated = np.zeros(rows, dtype=np.int32)
        self._num_cross = np.zeros(rows, dtype=np.int32)
        self._num_tokens = np.zeros(rows, dtype=np.int64)  # by row0: logical length
        self._num_prompt = np.zeros(rows, dtype=np.int64)  # by row0: len(prompt)
        self._num_committed = np.zeros(rows, dtype=np.int64)  # by row0: committed tokens
        self._tail = np.zeros((rows, block_size), dtype=np.int64)  # by row0: see module doc
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out row 0 first
        self._requests: dict[Hashable, Request] = {}
        # request id -> its beam-0 row (a row never changes while the request is alive)
        self._row0: dict[Hashable, int] = {}
        # the last beam-0 batch looked up: (tuple of request ids, read-only rows); cleared
        # whenever a request is dropped (its row may then be handed to another request)
        self._last_batch: tuple[tuple, np.ndarray] | None = None
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self._num_multi_beam = 0  # active requests with beam_width > 1

    # ------------------------------------------------------------------ queries
    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def num_tokens(self, request_id: Hashable) -> int:
        """Logical length (prompt + every extend - rewinds)."""
        return int(self._num_tokens[self._get(request_id).rows[0]])

    def num_committed_tokens(self, request_id: Hashable) -> int:
        return int(self._num_committed[self._get(request_id).rows[0]])

    def num_logical_blocks(self, request_id: Hashable) -> int:
        return -(-self.num_tokens(request_id) // self.block_size)

    def num_allocated_blocks(self, request_id: Hashable) -> int:
        """Logical plus reserved blocks of each beam."""
        return int(self._num_allocated[self._get(request_id).rows[0]])

    def beam_width(self, request_id: Hashable) -> int:
        return self._get(request_id).beam_width

    def get_block_ids(self, request_id: Hashable, pool: int = 0, *, beam: int = 0) -> list[int]:
        """All allocated blocks (logical and reserved) of one beam, in sequence order
        (block 0 where ``release_out_of_window`` freed a block)."""
        row = self._row(request_id, beam)
        return self._tables[self._check_pool(pool), row, : self._num_allocated[row]].tolist()

    def get_cross_block_ids(self, request_id: Hashable, pool: int = 0) -> list[int]:
        """The request's encoder blocks (shared by its beams)."""
        row = self._get(request_id).rows[0]
        return self._cross[self._check_pool(pool), row, : self._num_cross[row]].tolist()

    def get_state_slot(self, request_id: Hashable) -> int:
        """The request's state slot (SWA ring); ValueError when the manager has none."""
        slot = self._get(request_id).state_slot
        if slot is None:
            raise ValueError("this manager was built with num_state_slots = 0")
        return slot

    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    # ------------------------------------------------------------------ lookups
    def _check_pool(self, pool: int) -> int:
        if not 0 <= pool < self._tables.shape[0]:
            raise ValueError(f"pool {pool} outside [0, {self._tables.shape[0]})")
        return pool

    def _get(self, request_id: Hashable) -> Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown request id {request_id!r} (never added, or already freed)"
            ) from None

    def _row(self, request_id: Hashable, beam: int) -> int:
        req = self._get(request_id)
        if not 0 <= beam < req.beam_width:
            raise ValueError(f"beam {beam} outside [0, {req.beam_width}) for {request_id!r}")
        return req.rows[beam]

    def _seq_rows(self, request_ids: Sequence[Hashable], beams: Sequence[int] | None) -> np.ndarray:
        """Table rows of the listed sequences, int64 ``[n]`` (read-only; do not write it).

        Beam-0 lookups go through the ``request id -> row`` dict, and the last batch is
        remembered: a decode loop that asks for the same batch every step pays one tuple
        hash and compare instead of one dict lookup per request.
        """
        n = len(request_ids)
        try:
            if beams is None:
                key = request_ids if isinstance(request_ids, tuple) else tuple(request_ids)
                last = self._last_batch
                if last is not None and last[0] == key:
                    return last[1]
                rows = np.fromiter(map(self._row0.__getitem__, key), np.int64, n)
                rows.flags.writeable = False
                self._last_batch = (key, rows)
                return rows
            if len(beams) != n:
                raise ValueError(f"beams has {len(beams)} entries for {n} request ids")
            if min(beams, default=0) < 0:
                raise IndexError
            reqs = self._requests
            return np.fromiter((reqs[r].rows[b] for r, b in zip(request_ids, beams)), np.int64, n)
        except (KeyError, TypeError, IndexError):
            for i, r in enumerate(request_ids):  # slow path: name the offending entry
                self._row(r, 0 if beams is None else beams[i])
            raise

    # ------------------------------------------------------------------ row management
    def _new_request(
        self, request_id, prompt, beam_width, num_encoder_tokens, cacheable
    ) -> Request:
        while len(self._free_rows) < beam_width:
            self._grow_rows()
        rows = [self._free_rows.pop() for _ in range(beam_width)]
        slot = self._free_slots.pop() if self.num_state_slots else None
        req = Request(prompt, beam_width, rows, num_encoder_tokens, cacheable, slot)
        row0 = rows[0]
        self._num_tokens[row0] = self._num_prompt[row0] = len(prompt)
        self._num_committed[row0] = 0
        self._requests[request_id] = req
        self._row0[request_id] = rows[0]
        self._num_multi_beam += beam_width > 1
        return req

    def _drop_request(self, request_id: Hashable) -> None:
        req = self._requests.pop(request_id)
        del self._row0[request_id]
        self._last_batch = None
        self._num_multi_beam -= req.beam_width > 1
        self._free_rows.extend(reversed(req.rows))
        if req.state_slot is not None:
            self._free_slots.append(req.state_slot)

    def _grow_rows(self) -> None:
        old = self._num_allocated.size
        new = 2 * old
        pad = ((0, 0), (0, new - old), (0, 0))
        self._tables = np.pad(self._tables, pad)
        self._cross = np.pad(self._cross, pad)
        self._num_allocated = np.pad(self._num_allocated, (0, new - old))
        self._num_cross = np.pad(self._num_cross, (0, new - old))
        self._num_tokens = np.pad(self._num_tokens, (0, new - old))
        self._num_prompt = np.pad(self._num_prompt, (0, new - old))
        self._num_committed = np.pad(self._num_committed, (0, new - old))
        self._tail = np.pad(self._tail, ((0, new - old), (0, 0)))
        self._free_rows[:0] = range(new - 1, old - 1, -1)

    def _set_blocks(self, pool: int, row: int, blocks: list[int]) -> None:
        """Give ``row`` exactly ``blocks`` in ``pool`` (all pools get the same count)."""
        n = len(blocks)
        self._tables[pool, row, :n] = blocks
        self._tables[pool, row, n:] = 0
        self._num_allocated[row] = n

    def _append_blocks(self, row: int, blocks_per_pool: list[list[int]]) -> None:
        """Append one equally long list of blocks per pool to ``row``."""
        n = int(self._num_allocated[row])
        k = len(blocks_per_pool[0])
        for pool, blocks in enumerate(blocks_per_pool):
            assert len(blocks) == k, "every pool grows by the same number of blocks"
            self._tables[pool, row, n : n + k] = blocks
        self._num_allocated[row] = n + k

    def _truncate_blocks(self, row: int, keep: int) -> list[list[int]]:
        """Cut ``row`` to ``keep`` blocks; returns the removed blocks per pool (in order)."""
        n = int(self._num_allocated[row])
        if keep >= n:
            return [[] for _ in range(self._tables.shape[0])]
        removed = self._tables[:, row, keep:n].tolist()
        self._tables[:, row, keep:n] = 0
        self._num_allocated[row] = keep
        return removed

    def _set_cross_blocks(self, pool: int, row: int, blocks: list[int]) -> None:
        self._cross[pool, row, : len(blocks)] = blocks
        self._num_cross[row] = len(blocks)

    def _take_cross_blocks(self, row: int) -> list[list[int]]:
        """Remove the request's encoder blocks; returns them per pool."""
        n = int(self._num_cross[row])
        blocks = self._cross[:, row, :n].tolist()
        self._cross[:, row, :n] = 0
        self._num_cross[row] = 0
        return blocks
