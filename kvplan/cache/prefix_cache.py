"""Committed tokens and the prefix cache: which full blocks are hashed, and prompt lookups.

A block becomes findable by other requests only once every one of its tokens is *committed*
(its K/V written): then its chained hash ``H(parent, tokens)`` is computed and offered to every
pool's cache (``BlockPool.cache_block``). The chain ``Request.hashes`` always covers the
request's hashable full blocks, so a prompt lookup walks the chain block by block and stops at
the first block a pool needs and does not hold (a pool that releases out-of-window blocks
needs only the blocks the request's first computed query can see).

Which blocks are hashable: none of a cross-attention request; for beam_width > 1 only the
prompt's full blocks (shared by every beam; later blocks differ per beam).

Per-sequence state beside the blocks (``PrefixCache.state``, a `PrefixState`): a model whose
layers also carry state that blocks do not hold (a sliding-window ring, a compressor's
pending rows: `kvplan.backends.hybrid.snapshots`) can resume a prefix only where that state
was kept. Such a family installs a `PrefixState`: a match then ends at the longest run whose
last block's hash it can resume from, it hears of every block the manager hashes, and of
resets.

Pending blocks: an admitted request's prompt blocks that are not committed yet will be cached
once its prefill writes them. Their chained hashes are computed at admission (`add_pending`;
the commit then takes them instead of hashing again) and kept in ``pending`` until committed
or freed, so a lookup can say how much of a prompt another request is computing right now
(`match_runs`' ``pending_end``): the scheduler lets such a prompt wait for those blocks
instead of computing them a second time.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

from kvplan.cache.block_pool import BlockPool, iter_block_hashes
from kvplan.cache.request_table import Request, RequestTable


class PrefixCacheStats(NamedTuple):
    """Prompt tokens looked up in the prefix cache by successful ``add_request`` calls, and
    how many of them were reused."""

    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class PrefixMatch(NamedTuple):
    """A prompt's lookup (`PrefixCache.match_runs`).

    ``hashes`` / ``blocks``: the reusable run (`PrefixCache.match`). ``num_shared``: blocks of
    the longest cached run before the ``state`` gate (>= ``len(hashes)``). ``pending_end``:
    when the blocks right after the cached run are pending (asked for), the number of
    leading blocks through the last of them (cached ones, then pending ones), else 0;
    ``owner``: the id of a request that will commit that whole run (None without one)."""

    hashes: list[bytes]
    blocks: list[list[int]]
    num_shared: int
    pending_end: int = 0
    owner: Hashable = None


class PrefixState(Protocol):
    """State kept beside cached blocks (module docstring)."""

    def can_end(self, block_hash: bytes) -> bool:
        """Whether a prefix hit may end with the block hashed ``block_hash``."""

    def blocks_hashed(self, request_id: Hashable, first_block: int, hashes: list[bytes]) -> None:
        """Blocks ``first_block ..`` of ``request_id`` were just hashed as ``hashes``."""

    def reset(self) -> None:
        """The prefix cache forgot every hash."""


class PrefixCache:
    """Hash committed full blocks into the pools' caches and match prompts against them.

    Args:
        pools: every pool (a block is cached in all of them, or a match needs all of them).
        table: the request table (committed counts, tails, block tables).
        block_size: tokens per block.
    """

    def __init__(
        self,
        pools: list[BlockPool],
        table: RequestTable,
        block_size: int,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        self.pools = pools
        self.table = table
        self.block_size = block_size
        # (pool, window) of the pools that release out-of-window blocks (None: none do)
        self.lazy = [(p, w) for p, w in enumerate(windows or ()) if w is not None]
        self._lazy_pools = {p for p, _ in self.lazy}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.state: PrefixState | None = None  # per-sequence state beside the blocks
        # hash -> ids of the admitted requests that will commit that block (module docstring)
        self.pending: dict[bytes, list[Hashable]] = {}

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.num_queried_tokens, self.num_hit_tokens)

    def record_lookup(self, num_prompt: int, num_hit_tokens: int) -> None:
        """Count one successful ``add_request`` lookup in the stats."""
        self.num_queried_tokens += num_prompt
        self.num_hit_tokens += num_hit_tokens

    def reset(self) -> None:
        """Forget every cached hash. Blocks in use stay allocated."""
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.state is not None:
            self.state.reset()

    def match(self, prompt: list[int]) -> tuple[list[bytes], list[list[int]]]:
        """Longest run of cached full blocks, leaving >= 1 token to compute.

        A run of ``j`` blocks needs every block in the full pools, and in a pool that
        releases out-of-window blocks (window ``W``) only the blocks a query at position
        ``j * block_size`` can see: columns ``>= max(0, j * block_size - W + 1) //
        block_size`` (the allocator takes back exactly those; earlier entries are 0). With a
        ``state``, the run's last block must also be one it can resume from.

        Returns ``(hashes, blocks)``: the chained hash of each matched block and, per matched
        block, its id in each pool.
        """
        m = self.match_runs(prompt)
        return m.hashes, m.blocks

    def match_runs(self, prompt: Sequence[int], *, pending: bool = False) -> PrefixMatch:
        """`match`, plus the number of blocks of the longest run before the ``state`` had
        its say (>= the matched run): blocks the cache holds that the request must recompute
        because no state was kept at their end. ``pending``: also count the blocks after the
        raw cached run that admitted requests are computing (``PrefixMatch.pending_end``)."""
        bs = self.block_size
        hashes: list[bytes] = []
        blocks: list[list[int]] = []
        lazy = self._lazy_pools
        chain = iter_block_hashes(prompt, bs, (len(prompt) - 1) // bs)
        miss = None
        for parent in chain:
            found = [pool.lookup(parent) for pool in self.pools]
            if any(x is None for p, x in enumerate(found) if p not in lazy):
                miss = parent
                break
            hashes.append(parent)
            blocks.append(found)
        pending_end, owner = 0, None
        if pending and miss is not None and miss in self.pending:
            owners = self.pending[miss]
            pending_end = len(blocks) + 1
            for h in chain:
                if h not in self.pending:
                    break
                owners = self.pending[h]
                pending_end += 1
            owner = owners[0]  # it commits the whole run: the chain holds its earlier blocks
        j = len(blocks)
        while j and not self._window_hits(blocks, j):
            j -= 1
        shared = j
        state = self.state
        while j and state is not None and not state.can_end(hashes[j - 1]):
            j -= 1
        for row in blocks[:j]:
            for p in lazy:
                row[p] = row[p] or 0
        return PrefixMatch(hashes[:j], blocks[:j], shared, pending_end, owner)

    def add_pending(self, req: Request) -> None:
        """Hash ``req``'s prompt blocks past its committed ones (after its lookup's hits) and
        register them as pending (module docstring); a no-op for a request whose blocks are
        not hashable."""
        if not req.cacheable:
            return
        bs = self.block_size
        first, last = len(req.hashes), len(req.prompt) // bs
        if last <= first:
            return
        parent = req.hashes[-1] if req.hashes else None
        chain = list(iter_block_hashes(req.prompt[first * bs : last * bs], bs, last - first,
                                       parent))  # fmt: skip
        req.prompt_hashes = req.hashes + chain
        pending = self.pending
        rid = req.request_id
        for h in chain:
            owners = pending.get(h)
            if owners is None:
                pending[h] = [rid]
            else:
                owners.append(rid)

    def drop_pending(self, req: Request) -> None:
        """``req`` leaves (freed): its uncommitted prompt blocks are no longer pending."""
        self._unpend(req, len(req.hashes), len(req.prompt_hashes))
        req.prompt_hashes = []

    def _unpend(self, req: Request, start: int, end: int) -> None:
        pending, rid = self.pending, req.request_id
        for h in req.prompt_hashes[start:end]:
            owners = pending.get(h)
            if owners is None:
                continue
            owners.remove(rid)
            if not owners:
                del pending[h]

    def _window_hits(self, blocks: list[list[int | None]], j: int) -> bool:
        """Whether every windowed pool holds the blocks a run of ``j`` blocks needs there."""
        for p, window in self.lazy:
            lo = max(0, j * self.block_size - window + 1) // self.block_size
            if any(blocks[b][p] is None for b in range(lo, j)):
                return False
        return True

    def commit(self, req: Request, start: int, token_ids: Sequence[int]) -> None:
        """Commit ``token_ids`` at positions ``start ..`` of ``req``: keep the last partial
        block's tokens in the table's ``tail`` and hash each block they fill (the whole
        blocks inside ``token_ids`` in one run, `blocks_filled`)."""
        bs = self.block_size
        row0 = req.rows[0]
        tail = self.table.tail[row0]
        n = len(token_ids)
        b, off = divmod(start, bs)
        i = 0
        if off:  # the partial block in the tail first
            i = min(bs - off, n)
            tail[off : off + i] = token_ids[:i]
            if off + i == bs:
                self.blocks_filled(req, b, tail, 1)
            b += 1
        full = (n - i) // bs
        if full:
            self.blocks_filled(req, b, token_ids[i : i + full * bs], full)
            i += full * bs
        if i < n:
            tail[: n - i] = token_ids[i:]
        self.table.num_committed[row0] = start + n

    def block_filled(self, req: Request, b: int, tokens: Sequence[int]) -> None:
        """Block ``b`` of ``req`` is now fully committed with ``tokens`` ([block_size]):
        hash it and offer it to every pool's cache (when hashable, see the module doc)."""
        self.blocks_filled(req, b, tokens, 1)

    def blocks_filled(self, req: Request, b: int, tokens: Sequence[int], count: int) -> None:
        """Blocks ``b .. b + count - 1`` of ``req`` are now fully committed with ``tokens``
        (``[count * block_size]``): hash those that are hashable (module doc) and offer each
        to every pool's cache."""
        if not req.cacheable:
            return
        if req.beam_width > 1:  # later blocks differ per beam
            count = min(count, len(req.prompt) // self.block_size - b)
            if count <= 0:
                return
        assert b == len(req.hashes), f"block {b} filled with {len(req.hashes)} blocks hashed"
        # prompt blocks were hashed at admission (`add_pending`); hash only the others
        known = max(0, min(count, len(req.prompt_hashes) - b))
        hashes = req.prompt_hashes[b : b + known]
        if known:
            self._unpend(req, b, b + known)
        if known < count:
            bs = self.block_size
            parent = hashes[-1] if hashes else (req.hashes[-1] if req.hashes else None)
            hashes += iter_block_hashes(tokens[known * bs :], bs, count - known, parent)
        ids = self.table.tables[:, req.rows[0], b : b + count].tolist()  # [pools][count]
        pools = self.pools
        for j, h in enumerate(hashes):
            for p, pool in enumerate(pools):
                block = ids[p][j]
                if block:  # 0: already released out of the window
                    pool.cache_block(block, h)
            req.hashes.append(h)
        if self.state is not None:
            self.state.blocks_hashed(req.request_id, b, req.hashes[b:])
