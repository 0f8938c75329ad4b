"""Snapshots of per-sequence state, so that a reused prefix resumes exactly (prefix caching).

A hybrid layer keeps two kinds of state. Compressed entries (and the indexer's keys) live in
paged blocks: block ``b`` holds the entries of raw positions ``[b * B, (b + 1) * B)`` (``B``
the block size, a multiple of every ratio) and they depend only on the tokens up to there, so
a full block is shared like a dense model's KV block. The sliding-window ring and the
compressor-state ring live in the request's *state slot* and are overwritten as it advances.

A request that reuses the first ``h`` tokens of a cached prefix (``h`` a multiple of ``B``)
needs, in its own state slot, what a request that computed those ``h`` tokens held at that
moment: per layer the ring rows of positions ``[h - W, h)`` (``W`` the ring size), and per
overlapping (CSA) series the compressor-state rows of ``[h - 2r, h)`` (the next window reads
the previous window's first-half rows). A non-overlapping (HCA) series has no pending rows at
a multiple of its ratio, so it needs nothing. :class:`StateSnapshots` keeps copies of exactly
these tensors: ``capacity`` snapshot slots, each the ring of every layer and the state rows of
every overlapping series of one state slot at one block boundary.

Bookkeeping (host): a snapshot is *taken* into a free slot right after the step whose rows end
at a boundary (stream-ordered device copies, before any later step rewrites the ring), or,
for a boundary inside a prompt chunk, right before that step, which then writes the rows up to
the boundary into it (:class:`KeepPoints`), and
*registered* under the chained hash of the prefix's last block once the cache manager hashes
that block. A registered snapshot is found by hash (`lookup`), restored into a new request's
state slot, and evicted least recently used when a new snapshot needs a slot. A taken
snapshot whose block is never hashed is dropped with its request (`drop_pending`).

Values: a restored slot holds bit for bit what the snapshotted slot held, so the request
continues as the snapshotted one would have (tested against HF's full forward through the
engine: `tests/engine/test_hybrid_prefix_cache.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvplan.backends.hybrid.planned import PlannedHybridFamily


class StateSnapshots:
    """Snapshot slots of a `PlannedHybridFamily`'s state (module docstring).

    Args:
        family: the family whose rings and compressor states are copied.
        capacity: snapshot slots (>= 1); each costs what one state slot's ring and
            overlapping compressor rows cost (`nbytes_per_snapshot`).
    """

    def __init__(self, family: PlannedHybridFamily, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.family = family
        self.capacity = capacity
        # (live cache view [slots, ...], its snapshot copy [capacity, ...]) per state tensor
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        # per layer: the ring's copy; per (layer, series): the (kv, gate) state copies,
        # [capacity, R, width] (`KeepPoints` writes into them)
        self.rings: list[torch.Tensor] = []
        self.states: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        slots = family.config.num_state_slots
        for i, layer in enumerate(family.caches):
            ring = layer.ring.cache  # [num_state_slots, ring_size, ...]
            self.rings.append(ring.new_zeros((capacity, *ring.shape[1:])))
            self._pairs.append((ring, self.rings[-1]))
            spec = layer.spec
            if not spec.ratio or not spec.overlap:
                continue  # HCA / sliding: nothing pending at a block boundary
            for name, kv_gate in layer.state.items():
                copies = []
                for t in kv_gate:  # [slots * R + 1 trash row, width]
                    live = t[:-1].view(slots, -1, t.shape[1])
                    copies.append(live.new_zeros((capacity, *live.shape[1:])))
                    self._pairs.append((live, copies[-1]))
                self.states[(i, name)] = (copies[0], copies[1])
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives 0, 1, ...
        self._by_hash: OrderedDict[Hashable, int] = OrderedDict()  # LRU first
        # request -> {block index: (slot, taken at a decode step)}
        self._pending: dict[Hashable, dict[int, tuple[int, bool]]] = {}
        self._latest: dict[Hashable, Hashable] = {}  # request -> hash of its last decode one
        self.num_taken = 0
        self.num_restored = 0
        self.num_evicted = 0

    @property
    def nbytes_per_snapshot(self) -> int:
        return sum(snap[0].numel() * snap.element_size() for _, snap in self._pairs)

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    @property
    def num_pending(self) -> int:
        return sum(len(p) for p in self._pending.values())

    # ---- host bookkeeping ---------------------------------------------------------------
    def lookup(self, block_hash: Hashable) -> int | None:
        """The slot registered under ``block_hash`` (None when there is none)."""
        return self._by_hash.get(block_hash)

    def take(self, entries: Sequence[tuple[Hashable, int, int, bool]]) -> int:
        """Snapshot state slots now: ``entries`` are ``(request_id, block index, state slot,
        decode)``, the state each request holds after its first ``(block index + 1) * B``
        tokens (``decode``: reached by a decode step; a request keeps only its newest such
        snapshot, see `register`). Each gets a free snapshot slot (the least recently used
        registered one is evicted when none is free; entries are skipped when every slot is
        pending) and stays pending until `register`. Returns how many were taken (`_copy`)."""
        return sum(slot is not None for slot in self.take_early(entries))

    def take_early(self, entries: Sequence[tuple[Hashable, int, int, bool]]) -> list[int | None]:
        """`take`, returning each entry's snapshot slot (None: skipped, every slot pending).
        Called before a step whose chunk passes the boundary, the copies hold the state
        before the step; the step then writes the rows up to the boundary (`KeepPoints`)."""
        out: list[int | None] = [None] * len(entries)
        dst: list[int] = []
        src: list[int] = []
        for i, (rid, block, sid, decode) in enumerate(entries):
            slot = self._alloc()
            if slot is None:
                break
            old = self._pending.setdefault(rid, {}).pop(block, None)
            if old is not None:  # the same boundary again (a recompute): keep the newest
                self._free.append(old[0])
            self._pending[rid][block] = (slot, decode)
            dst.append(slot)
            src.append(sid)
            out[i] = slot
        if dst:
            self._copy(src, dst, save=True)
            self.num_taken += len(dst)
        return out

    def register(self, request_id: Hashable, first_block: int, hashes: Sequence[Hashable]) -> None:
        """Blocks ``first_block ..`` of ``request_id`` were hashed as ``hashes``: register
        the request's pending snapshots at those boundaries under their hashes (a hash that
        already has one is refreshed with the newer copy). A snapshot taken at a decode step
        releases the request's previous decode-time one (its prefix is a prefix of the new
        one, and a conversation continues from the newest)."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        for i, h in enumerate(hashes):
            got = pending.pop(first_block + i, None)
            if got is None:
                continue
            slot, decode = got
            old = self._by_hash.pop(h, None)
            if old is not None:
                self._free.append(old)
            self._by_hash[h] = slot
            if decode:
                prev = self._latest.get(request_id)
                if prev is not None and prev != h and prev in self._by_hash:
                    self._free.append(self._by_hash.pop(prev))
                self._latest[request_id] = h
        if not pending:
            del self._pending[request_id]

    def discard(self, request_id: Hashable, block: int) -> bool:
        """Forget ``request_id``'s pending snapshot at block ``block`` (its state turned out
        not to be the request's: a speculative step's rejected drafts wrote it); returns
        whether there was one."""
        pending = self._pending.get(request_id)
        got = None if pending is None else pending.pop(block, None)
        if got is None:
            return False
        self._free.append(got[0])
        if not pending:
            del self._pending[request_id]
        return True

    def drop_pending(self, request_id: Hashable) -> None:
        """Forget a request: its unregistered snapshots go back to the free list (its
        registered ones stay findable)."""
        for slot, _ in self._pending.pop(request_id, {}).values():
            self._free.append(slot)
        self._latest.pop(request_id, None)

    def clear(self) -> None:
        """Forget every registered snapshot (the prefix cache was reset)."""
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()
        self._latest.clear()

    def restore(self, block_hash: Hashable, state_id: int) -> None:
        """Copy the snapshot registered under ``block_hash`` into ``state_id`` (queued on the
        device before the step that reads it) and mark it recently used. Raises ``KeyError``
        naming the hash when none is registered."""
        slot = self._by_hash.get(block_hash)
        if slot is None:
            raise KeyError(f"no state snapshot registered for block hash {block_hash!r}")
        self._by_hash.move_to_end(block_hash)
        self._copy([state_id], [slot], save=False)
        self.num_restored += 1

    # ---- internals ----------------------------------------------------------------------
    def _alloc(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._by_hash:
            return None
        _, slot = self._by_hash.popitem(last=False)  # least recently used
        self.num_evicted += 1
        return slot

    def _copy(self, state_ids: list[int], slots: list[int], *, save: bool) -> None:
        """Copy state slots to snapshot slots (``save``) or back: one slice copy per tensor
        for a single slot (every restore; most decode steps' takes), else one gather and one
        scatter per tensor."""
        if len(slots) == 1:
            sid, slot = state_ids[0], slots[0]
            for live, copy in self._pairs:
                if save:
                    copy[slot].copy_(live[sid])
                else:
                    live[sid].copy_(copy[slot])
            return
        dev = self.family.device
        sid = torch.tensor(state_ids, dtype=torch.int64).to(dev, non_blocking=True)
        snap = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        for live, copy in self._pairs:
            if save:
                copy.index_copy_(0, snap, live.index_select(0, sid))
            else:
                live.index_copy_(0, sid, copy.index_select(0, snap))


class KeepPoints:
    """Snapshots a prompt step completes inside its chunk (`StateSnapshots.take_early` copied
    the state slots before the step): ``points`` are ``(row, h, slot)``, step row (sequence)
    ``row`` keeps its state after its first ``h`` tokens (a block boundary strictly inside
    its chunk) in snapshot slot ``slot``.

    The state a chunk ending at ``h`` would leave is the state before the step with the rows
    of positions ``[q_start, h)`` written as that chunk writes them: the sliding-window ring's
    last ``ring_size`` of them (quantized by the ring's own store) and, per overlapping
    series, the compressor-state ring's last ``R`` (fp32 kv and biased gate). The step writes
    those rows into the snapshot slot (`rows`) beside its own writes, so the snapshot holds
    bit for bit what a cut chunk's snapshot holds (tested against one), and the prompt needs
    no second step."""

    def __init__(self, store: StateSnapshots, points: Sequence[tuple[int, int, int]]) -> None:
        self.store = store
        self.points = list(points)
        self._rows: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(
        self, q_start, cu_q, keep: int, device, dst_dtype: torch.dtype = torch.int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 step rows, ``dst_dtype`` rows of the ``[capacity * keep]`` flattened
        snapshot ring) that the points write into a ring of ``keep`` rows per slot (position
        ``p`` at ``slot * keep + p % keep``): each point's positions ``[max(q_start, h -
        keep), h)``. Cached per ``(keep, dst_dtype)`` (the step's layers share them)."""
        got = self._rows.get((keep, dst_dtype))
        if got is None:
            src, dst = [], []
            for row, h, slot in self.points:
                a = int(q_start[row])
                pos = np.arange(max(a, h - keep), h, dtype=np.int64)
                src.append(int(cu_q[row]) + pos - a)
                dst.append(slot * keep + pos % keep)
            got = (torch.from_numpy(np.concatenate(src)).to(device),
                   torch.from_numpy(np.concatenate(dst)).to(device, dst_dtype))  # fmt: skip
            self._rows[(keep, dst_dtype)] = got
        return got
