"""Typed outcomes of the KV cache manager's allocation calls (no sentinel ints)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple


class AllocationResult(NamedTuple):
    """Outcome of ``add_request`` / ``extend`` / ``reserve``.

    ``ok``: everything was allocated. ``num_cached_tokens``: prompt tokens reused from the
    prefix cache (a multiple of block_size, < len(prompt); 0 for extend/reserve).
    ``num_missing_blocks``: when not ok, the largest shortfall over the pools (free at least
    that many blocks in that pool and retry). ``reason``: "" | "blocks" | "state_slots" |
    "pending_prefix" (``add_request(wait_for_pending=True)``: blocks after the cached run are
    being computed by the request ``pending_owner``; ``num_shared_tokens`` is the end of
    that run).
    ``missing_per_pool``: the shortfall of each pool. ``num_shared_tokens``: prompt tokens in
    cached blocks (>= ``num_cached_tokens``): with a ``PrefixCache.state``, a hit can end
    only where per-sequence state was kept, so the request recomputes the blocks after it;
    a family that keeps state at chunk ends can end a chunk here for the next such request.
    """

    ok: bool
    num_cached_tokens: int = 0
    num_missing_blocks: int = 0
    reason: str = ""
    missing_per_pool: tuple[int, ...] = ()
    num_shared_tokens: int = 0
    pending_owner: Hashable = None


ALLOCATED = AllocationResult(True)


class BatchAllocationResult(NamedTuple):
    """Outcome of ``extend_many``: requests are extended in order up to the first that cannot
    get its blocks.

    ``num_extended``: requests ``[0, num_extended)`` of the batch were extended; the others
    are unchanged. ``failure``: ``ALLOCATED`` (ok) when the whole batch was extended, else the
    `AllocationResult` that ``extend`` returns for request ``num_extended`` (its shortfall
    counted after the earlier requests took their blocks).

    Example::

        r = m.extend_many(["a", "b", "c"], 1)
        if not r.ok:
            victim_needed_for = ["a", "b", "c"][r.num_extended]   # "b": no block for it
    """

    num_extended: int
    failure: AllocationResult = ALLOCATED

    @property
    def ok(self) -> bool:
        return self.failure.ok
