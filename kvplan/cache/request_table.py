"""The request table: per-request state, its table rows and the numpy block tables.

Each (request, beam) owns one *row*; ``tables[pool, row, j]`` is the row's j-th block (0 past
its allocated count, so padding is block 0), ``num_allocated[row]`` its allocated count (equal
in every pool). A request's cross-attention (encoder) blocks live in ``cross[pool, row0, :]``
with ``row0`` its beam-0 row. Rows are recycled; the arrays grow by doubling, so holders must
read them from the table each time (never keep an array across a mutation).

The per-request lengths are numpy arrays indexed by ``row0`` too, so that a decode step can
update a whole batch with a few numpy operations (``kvplan.cache.decode_step``):

* ``num_tokens[row0]``: the logical length; ``num_prompt[row0]``: ``len(prompt)``;
* ``num_committed[row0]``: committed tokens;
* ``tail[row0, :]``: the committed tokens of the last, partly committed block (int64
  ``[block_size]``; entry ``i`` is position ``(num_committed // block_size) * block_size + i``).
  Tokens of full committed blocks are not kept: a full block is hashed the moment it fills
  (the chain ``Request.hashes`` always covers every hashable full block), so nothing reads
  them again.

The table holds integers only; which blocks to put in a row is the pools' business
(``kvplan.cache.pool_group``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Request:
    """One active request: its prompt, beams (one table row each) and prefix-hash chain."""

    prompt: list[int]
    beam_width: int
    rows: list[int]  # rows[beam]; rows[0] indexes the per-request length arrays
    num_encoder_tokens: int
    cacheable: bool  # full blocks are offered to the prefix cache
    state_slot: int | None
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks 0, 1, ..
    # the chain over every full prompt block, hashed at admission (`PrefixCache.add_pending`;
    # ``hashes`` is its committed prefix); empty when the prompt's blocks are not hashable
    prompt_hashes: list[bytes] = field(default_factory=list)
    request_id: Hashable = None  # the id the table knows it by


class RequestTable:
    """Rows, block tables, lengths and state slots of the active requests, by request id.

    Args:
        num_pools: pools (tables) per row.
        max_blocks_per_seq: width of every table row.
        num_state_slots: state slots handed out one per request (0 = none).
        block_size: tokens per block (width of ``tail``).
    """

    INITIAL_ROWS = 64

    def __init__(
        self, num_pools: int, max_blocks_per_seq: int, num_state_slots: int, block_size: int
    ) -> None:
        rows = self.INITIAL_ROWS
        self.num_pools = num_pools
        self.num_state_slots = num_state_slots
        self.tables = np.zeros((num_pools, rows, max_blocks_per_seq), dtype=np.int32)
        self.cross = np.zeros((num_pools, rows, max_blocks_per_seq), dtype=np.int32)
        self.num_allocated = np.zeros(rows, dtype=np.int32)
        self.num_cross = np.zeros(rows, dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # by row0: logical length
        self.num_prompt = np.zeros(rows, dtype=np.int64)  # by row0: len(prompt)
        self.num_committed = np.zeros(rows, dtype=np.int64)  # by row0: committed tokens
        self.tail = np.zeros((rows, block_size), dtype=np.int64)  # by row0: see module doc
        self.num_multi_beam = 0  # active requests with beam_width > 1
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out row 0 first
        self._requests: dict[Hashable, Request] = {}
        # request id -> its beam-0 row (a row never changes while the request is alive)
        self._row0: dict[Hashable, int] = {}
        # the last beam-0 batch looked up: (tuple of request ids, read-only rows); cleared
        # whenever a request is dropped (its row may then be handed to another request)
        self._last_batch: tuple[tuple, np.ndarray] | None = None
        self._free_slots = list(range(num_state_slots - 1, -1, -1))

    # ------------------------------------------------------------------ lookups
    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Hashable]:
        """The active request ids, in the order they were added."""
        return iter(self._requests)

    def get(self, request_id: Hashable) -> Request:
        """The active request ``request_id``; ValueError when unknown."""
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown request id {request_id!r} (never added, or already freed)"
            ) from None

    def row(self, request_id: Hashable, beam: int) -> int:
        """Table row of one beam; ValueError for an unknown id or a beam out of range."""
        req = self.get(request_id)
        if not 0 <= beam < req.beam_width:
            raise ValueError(f"beam {beam} outside [0, {req.beam_width}) for {request_id!r}")
        return req.rows[beam]

    def check_pool(self, pool: int) -> int:
        if not 0 <= pool < self.num_pools:
            raise ValueError(f"pool {pool} outside [0, {self.num_pools})")
        return pool

    def seq_rows(self, request_ids: Sequence[Hashable], beams: Sequence[int] | None) -> np.ndarray:
        """Table rows of the listed sequences, int64 ``[n]`` (read-only; do not write it).

        Beam-0 lookups go through the ``request id -> row`` dict, and the last batch is
        remembered: a decode loop that asks for the same batch every step pays one tuple
        hash and compare instead of one dict lookup per request (and gets the same array
        object back).
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
                self.row(r, 0 if beams is None else beams[i])
            raise

    def block_ids(self, pool: int, row: int) -> list[int]:
        """The allocated blocks of ``row`` in ``pool``, in sequence order."""
        return self.tables[pool, row, : self.num_allocated[row]].tolist()

    def block_ids_view(self, pool: int, row: int) -> np.ndarray:
        """`block_ids` as a read-only view of the table (no copy; valid until the row's
        table next changes)."""
        view = self.tables[pool, row, : self.num_allocated[row]]
        view.flags.writeable = False
        return view

    def cross_block_ids(self, pool: int, row: int) -> list[int]:
        return self.cross[pool, row, : self.num_cross[row]].tolist()

    # ------------------------------------------------------------------ requests
    def has_free_state_slot(self) -> bool:
        return bool(self._free_slots)

    def add(
        self,
        request_id: Hashable,
        prompt: list[int],
        beam_width: int,
        num_encoder_tokens: int,
        cacheable: bool,
    ) -> Request:
        """Register a request: ``beam_width`` fresh rows (no blocks yet), a state slot when
        the table has any, logical length ``len(prompt)``, nothing committed."""
        while len(self._free_rows) < beam_width:
            self._grow_rows()
        rows = [self._free_rows.pop() for _ in range(beam_width)]
        slot = self._free_slots.pop() if self.num_state_slots else None
        req = Request(prompt, beam_width, rows, num_encoder_tokens, cacheable, slot,
                      request_id=request_id)  # fmt: skip
        row0 = rows[0]
        self.num_tokens[row0] = self.num_prompt[row0] = len(prompt)
        self.num_committed[row0] = 0
        self._requests[request_id] = req
        self._row0[request_id] = row0
        self.num_multi_beam += beam_width > 1
        return req

    def drop(self, request_id: Hashable) -> None:
        """Forget a request whose blocks were taken out; its rows and slot become free."""
        req = self._requests.pop(request_id)
        del self._row0[request_id]
        self._last_batch = None
        self.num_multi_beam -= req.beam_width > 1
        self._free_rows.extend(reversed(req.rows))
        if req.state_slot is not None:
            self._free_slots.append(req.state_slot)

    def _grow_rows(self) -> None:
        old = self.num_allocated.size
        new = 2 * old
        pad = ((0, 0), (0, new - old), (0, 0))
        self.tables = np.pad(self.tables, pad)
        self.cross = np.pad(self.cross, pad)
        self.num_allocated = np.pad(self.num_allocated, (0, new - old))
        self.num_cross = np.pad(self.num_cross, (0, new - old))
        self.num_tokens = np.pad(self.num_tokens, (0, new - old))
        self.num_prompt = np.pad(self.num_prompt, (0, new - old))
        self.num_committed = np.pad(self.num_committed, (0, new - old))
        self.tail = np.pad(self.tail, ((0, new - old), (0, 0)))
        self._free_rows[:0] = range(new - 1, old - 1, -1)

    # ------------------------------------------------------------------ rows
    def set_blocks(self, pool: int, row: int, blocks: list[int]) -> None:
        """Give ``row`` exactly ``blocks`` in ``pool`` (all pools get the same count)."""
        n = len(blocks)
        self.tables[pool, row, :n] = blocks
        self.tables[pool, row, n:] = 0
        self.num_allocated[row] = n

    def append_blocks(self, row: int, blocks_per_pool: list[list[int]]) -> None:
        """Append one equally long list of blocks per pool to ``row``."""
        n = int(self.num_allocated[row])
        k = len(blocks_per_pool[0])
        for pool, blocks in enumerate(blocks_per_pool):
            assert len(blocks) == k, "every pool grows by the same number of blocks"
            self.tables[pool, row, n : n + k] = blocks
        self.num_allocated[row] = n + k

    def truncate_blocks(self, row: int, keep: int) -> list[list[int]]:
        """Cut ``row`` to ``keep`` blocks; returns the removed blocks per pool (in order)."""
        n = int(self.num_allocated[row])
        if keep >= n:
            return [[] for _ in range(self.num_pools)]
        removed = self.tables[:, row, keep:n].tolist()
        self.tables[:, row, keep:n] = 0
        self.num_allocated[row] = keep
        return removed

    def set_cross_blocks(self, pool: int, row: int, blocks: list[int]) -> None:
        self.cross[pool, row, : len(blocks)] = blocks
        self.num_cross[row] = len(blocks)

    def take_cross_blocks(self, row: int) -> list[list[int]]:
        """Remove the request's encoder blocks; returns them per pool."""
        n = int(self.num_cross[row])
        blocks = self.cross[:, row, :n].tolist()
        self.cross[:, row, :n] = 0
        self.num_cross[row] = 0
        return blocks
