"""Block pool: integer block ids, reference counts, an LRU free list and a prefix cache.

The pool deals only in integer block ids; it never touches a tensor. Ids run from 1 to
``num_blocks - 1``: block 0 is the reserved padding block (block tables are padded with it, so a
kernel that reads a padded entry reads a valid, ignored block) and is never handed out.

Free list and eviction order
----------------------------
A block whose reference count drops to zero goes back to the free list. Blocks that carry a
prefix-cache hash keep it while they sit on the free list, so a later request with the same
prefix can take them back (``touch``). Allocation pops from the front of the free list and
evicts the popped block's hash:

* freed blocks *without* a hash go to the front (they hold nothing worth keeping);
* freed blocks *with* a hash go to the back, so among cached blocks the least recently freed
  one is evicted first.

Example (``num_blocks = 5``)::

    pool = BlockPool(5)            # free: [1, 2, 3, 4]
    a = pool.allocate(2)           # [1, 2]      free: [3, 4]
    pool.cache_block(1, b"h1")     # block 1 now findable by hash b"h1"
    pool.free([2, 1])              # free: [2, 3, 4, 1]  (2 has no hash -> front; 1 -> back)
    pool.lookup(b"h1")             # 1 (still cached while free)
    pool.allocate(3)               # [2, 3, 4]   free: [1]
    pool.allocate(1)               # [1]  -- evicts hash b"h1"
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

PADDING_BLOCK_ID = 0

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: ``H(parent_hash, token_ids)``.

    The chain makes a block's hash depend on every token before it, so equal hashes mean equal
    prefixes (up to a 128-bit collision). ``parent_hash`` is ``None`` for the first block.
    """
    return next(iter_block_hashes(token_ids, len(token_ids), 1, parent_hash))


def iter_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    parent_hash: BlockHash | None = None,
) -> Iterator[BlockHash]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids``, lazily, each
    equal to ``hash_block_tokens(previous, block)`` (the first block's parent is
    ``parent_hash``).

    The tokens become int64 bytes a run of blocks at a time (one numpy conversion per run,
    not per block: ~4x cheaper per block for a long prompt), so a caller that stops early
    (a prefix lookup's first miss) converts little more than it hashed."""
    parent = parent_hash if parent_hash is not None else _NO_PARENT
    run = _HASH_RUN_BLOCKS
    width = block_size * 8
    for b0 in range(0, num_blocks, run):
        b1 = min(num_blocks, b0 + run)
        buf = memoryview(
            np.asarray(token_ids[b0 * block_size : b1 * block_size], dtype=np.int64).tobytes()
        )
        for k in range(b1 - b0):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(buf[k * width : (k + 1) * width])
            parent = h.digest()
            yield parent


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[BlockHash]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
    return list(iter_block_hashes(token_ids, block_size, num_blocks))


_NO_PARENT = b"\x00" * 16  # the first block's parent in the chain
_HASH_RUN_BLOCKS = 32  # blocks converted to bytes at a time by iter_block_hashes


class BlockPool:
    """Reference-counted block ids ``1 .. num_blocks - 1`` with a hash -> block prefix cache.

    Args:
        num_blocks: number of blocks including the reserved padding block 0 (>= 2).
        enable_prefix_caching: when False, ``cache_block`` is a no-op and ``lookup`` misses.
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = np.zeros(num_blocks, dtype=np.int32)
        # Ordered set: the front is allocated (and evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_to_hash: dict[int, BlockHash] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (cached-but-free blocks included)."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return int(self._ref_counts[block_id])

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_block_ids(self) -> list[int]:
        """The free list, front (next to allocate / evict) first."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash`` (free or in use), or None."""
        return self._hash_to_block.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_to_hash.get(block_id)

    def cached_blocks(self) -> dict[BlockHash, int]:
        """Every cached hash and its block (a copy; free and in-use blocks alike)."""
        return dict(self._hash_to_block)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    # ------------------------------------------------------------------ mutations
    def allocate(self, num: int) -> list[int] | None:
        """Pop ``num`` blocks from the front of the free list (ref count 1 each).

        Returns None, changing nothing, when fewer than ``num`` blocks are free. A popped block
        that carried a prefix-cache hash loses it (eviction).
        """
        if num < 0:
            raise ValueError(f"num must be >= 0, got {num}")
        if num > len(self._free):
            return None
        pop = self._free.popitem
        out = [pop(last=False)[0] for _ in range(num)]
        if self._block_to_hash:
            for block_id in out:
                self._evict_hash(block_id)
        self._ref_counts[out] = 1
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix reuse, beams sharing a block).

        A block on the free list (cached, ref count 0) is taken off it, keeping its hash.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                if block_id not in self._free:
                    raise AssertionError(f"block {block_id} has ref count 0 but is not free")
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed block; blocks reaching zero return to the free list.

        Pass a request's blocks tail first: among cached blocks freed together, the earlier
        listed ones are evicted earlier, so freeing tail first keeps prefixes cached longest.

        Raises:
            ValueError: a block id out of range, the padding block, or a block already free
                (double free). Nothing is changed in that case.
        """
        block_ids = list(block_ids)
        pending: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            pending[block_id] = pending.get(block_id, 0) + 1
            if pending[block_id] > self._ref_counts[block_id]:
                raise ValueError(f"block {block_id} freed more often than referenced (double free)")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if block_id not in self._block_to_hash:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, written block under ``block_hash``.

        Returns True if the block is now findable by that hash. A hash that already names
        another block keeps its block (the newcomer stays uncached); a block already cached
        keeps its first hash.
        """
        self._check_id(block_id)
        if not self.enable_prefix_caching:
            return False
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only blocks in use can be cached")
        existing = self._hash_to_block.get(block_hash)
        if existing is not None:
            return existing == block_id
        if block_id in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use stay allocated)."""
        self._hash_to_block.clear()
        self._block_to_hash.clear()

    # ------------------------------------------------------------------ internals
    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_to_hash.pop(block_id, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]

    def _check_id(self, block_id: int) -> None:
        if not 1 <= block_id < self.num_blocks:
            if block_id == PADDING_BLOCK_ID:
                raise ValueError("block 0 is the reserved padding block and is never allocated")
            raise ValueError(f"block id {block_id} outside [1, {self.num_blocks})")
