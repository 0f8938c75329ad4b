"""KV cache manager: per-request block bookkeeping over one block pool per window size.

Integers and numpy only (the block-offset staging in ``copy_batch_block_offsets`` is the one
place a torch tensor is touched, in ``block_offsets.py``).

Vocabulary
----------
* *logical* length ``num_tokens(rid)``: tokens that count as the sequence (prompt, then every
  ``extend``); ``num_logical_blocks = ceil(num_tokens / block_size)``.
* *reserved* blocks: allocated past the logical blocks by ``reserve`` (speculative appends
  need them addressable); ``get_block_ids`` returns logical and reserved blocks together.
* *committed* tokens: tokens whose K/V is written, announced by ``commit_tokens``; only full
  committed blocks are hashed for prefix reuse (a block whose K/V is not written yet must not
  be found by another request).
* one *pool* per distinct sliding-window size (VSWA); ``layer_to_pool[layer]`` picks a
  layer's pool. Every pool's table covers the whole sequence; with ``release_out_of_window``
  a window pool frees the blocks no future query can see and leaves block 0 in their place.
* beams: the prompt's full blocks are shared by all beams (one reference per beam); the
  prompt's partial last block and all later blocks are per beam. Only beam 0's partial prompt
  block is written by the context step; ``beam_fork_copies`` lists the copies that give the
  other beams that content.
* cross attention: ``num_encoder_tokens > 0`` gives the request its own encoder blocks in every
  pool, shared by its beams.

Running out of blocks (or state slots) returns ``AllocationResult(ok=False, ...)`` and changes
nothing; caller errors (unknown id, double free, a sequence longer than
``max_blocks_per_seq`` blocks) raise ``ValueError``.

A decode step's per-request calls have batched forms, ``extend_many`` (-> a
``BatchAllocationResult``) and ``commit_tokens_many`` (``_batched.py``), equal to the
per-request calls in order but with numpy work over the batch and Python work only where a
block is allocated or fills.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from kvplan._checks import check_int32
from kvplan.cache import block_offsets as bo
from kvplan.cache._batched import BatchedUpdates
from kvplan.cache._requests import Request, RequestTable
from kvplan.cache._results import ALLOCATED, AllocationResult, BatchAllocationResult
from kvplan.cache.block_pool import BlockPool, hash_block_tokens

__all__ = ["AllocationResult", "BatchAllocationResult", "KVCacheManager", "PrefixCacheStats"]


class PrefixCacheStats(NamedTuple):
    """Prompt tokens looked up in the prefix cache by successful ``add_request`` calls, and
    how many of them were reused."""

    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(BatchedUpdates, RequestTable, bo.BatchViews):
    """Block bookkeeping for a paged KV cache.

    Args:
        num_blocks: blocks per pool including the padding block 0 (an int, or one per pool).
        block_size: tokens per block.
        max_blocks_per_seq: width of every block table (longest sequence in blocks).
        window_sizes: the distinct sliding-window sizes, one pool each (None = full attention).
        layer_to_pool: ``layer -> pool index`` (sequence or mapping); None maps every layer to
            pool 0 and is only allowed with one pool.
        enable_prefix_caching: reuse full blocks of identical prompt prefixes.
        release_out_of_window: in pools with a window W, free a request's blocks that no
            future query can see (every position < committed - W + 1) as tokens are
            committed. Their table entries become block 0 (holes; ``num_allocated_blocks``
            still counts them), so consumers must take counts from the manager, not from the
            nonzero entries. Off by default.
        num_state_slots: per-request state slots (SWA ring buffers); 0 = none.
        max_beam_width: largest beam width a request may ask for.

    Example::

        m = KVCacheManager(num_blocks=8, block_size=4, max_blocks_per_seq=4)
        m.add_request("a", [1, 2, 3, 4, 5])   # AllocationResult(ok=True, ...)
        m.get_block_ids("a")                  # [1, 2]
        m.extend("a", 4)                      # 9 tokens -> blocks [1, 2, 3]
    """

    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        *,
        max_blocks_per_seq: int,
        window_sizes: Sequence[int | None] = (None,),
        layer_to_pool: Sequence[int] | Mapping[int, int] | None = None,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        max_beam_width: int = 1,
        release_out_of_window: bool = False,
    ) -> None:
        window_sizes = tuple(window_sizes)
        if not window_sizes:
            raise ValueError("window_sizes must name at least one pool")
        if len(set(window_sizes)) != len(window_sizes):
            raise ValueError(f"window_sizes must be distinct (one pool each), got {window_sizes}")
        for w in window_sizes:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"window_sizes entries must be None or ints >= 1, got {w!r}")
        num_pools = len(window_sizes)
        if isinstance(num_blocks, int):
            num_blocks = (num_blocks,) * num_pools
        num_blocks = tuple(num_blocks)
        if len(num_blocks) != num_pools:
            raise ValueError(f"num_blocks has {len(num_blocks)} entries for {num_pools} pools")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(max_blocks_per_seq, int) or max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be an int >= 1, got {max_blocks_per_seq!r}")
        if max_beam_width < 1:
            raise ValueError(f"max_beam_width must be >= 1, got {max_beam_width}")
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        for n in num_blocks:  # slots (block * block_size + offset) are int32
            check_int32("num_blocks * block_size", n * block_size)
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_blocks_per_seq * block_size
        self.window_sizes = window_sizes
        self.num_pools = num_pools
        self.enable_prefix_caching = enable_prefix_caching
        self.release_out_of_window = release_out_of_window
        self.max_beam_width = max_beam_width
        self.num_state_slots = num_state_slots
        self.pools = [BlockPool(n, enable_prefix_caching=enable_prefix_caching) for n in num_blocks]
        self.layer_to_pool = self._check_layer_map(layer_to_pool)
        super().__init__(num_pools, max_blocks_per_seq, num_state_slots, block_size)
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._stagers: dict[tuple[bool, int], bo.BlockOffsetsStager] = {}

    @classmethod
    def from_layer_windows(
        cls,
        num_blocks: int | Sequence[int],
        block_size: int,
        layer_windows: Sequence[int | None],
        **kwargs,
    ) -> KVCacheManager:
        """One pool per distinct window of ``layer_windows`` (in first-seen order)."""
        windows: list[int | None] = []
        for w in layer_windows:
            if w not in windows:
                windows.append(w)
        layer_to_pool = [windows.index(w) for w in layer_windows]
        return cls(
            num_blocks, block_size, window_sizes=windows, layer_to_pool=layer_to_pool, **kwargs
        )

    def _check_layer_map(self, layer_to_pool) -> dict[int, int] | None:
        if layer_to_pool is None:
            if self.num_pools != 1:
                raise ValueError(f"layer_to_pool is required with {self.num_pools} pools")
            return None
        items = (
            layer_to_pool.items()
            if isinstance(layer_to_pool, Mapping)
            else enumerate(layer_to_pool)
        )
        out = {}
        for layer, pool in items:
            if not 0 <= pool < self.num_pools:
                raise ValueError(f"layer_to_pool[{layer}] = {pool} outside [0, {self.num_pools})")
            out[int(layer)] = int(pool)
        return out

    def pool_for_layer(self, layer_idx: int | None) -> int:
        """Pool index of ``layer_idx`` (None -> pool 0)."""
        if layer_idx is None or self.layer_to_pool is None:
            return 0
        try:
            return self.layer_to_pool[layer_idx]
        except KeyError:
            raise ValueError(f"layer_idx {layer_idx} has no pool in layer_to_pool") from None

    # ------------------------------------------------------------------ capacity queries
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_queried_tokens, self._num_hit_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay allocated; blocks completed by later
        commits are hashed as usual."""
        for pool in self.pools:
            pool.reset_prefix_cache()

    def num_free_blocks(self, pool: int = 0) -> int:
        return self.pools[self._check_pool(pool)].num_free_blocks

    def can_allocate(self, num_tokens: int, pool: int = 0) -> bool:
        """Whether a new single-beam sequence of ``num_tokens`` tokens fits in ``pool`` now."""
        return _cdiv(num_tokens, self.block_size) <= self.num_free_blocks(pool)

    def _check_len(self, name: str, num_tokens: int) -> int:
        num_blocks = _cdiv(num_tokens, self.block_size)
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(
                f"{name} = {num_tokens} tokens needs {num_blocks} blocks, more than "
                f"max_blocks_per_seq = {self.max_blocks_per_seq}"
            )
        return num_blocks

    def _shortfall(self, need: Sequence[int]) -> AllocationResult | None:
        missing = tuple(max(0, n - p.num_free_blocks) for n, p in zip(need, self.pools))
        if any(missing):
            return AllocationResult(False, 0, max(missing), "blocks", missing)
        return None

    # ------------------------------------------------------------------ lifecycle
    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        *,
        beam_width: int = 1,
        num_encoder_tokens: int = 0,
    ) -> AllocationResult:
        """Allocate blocks for the whole prompt, reusing cached full prefix blocks.

        The logical length becomes ``len(prompt_token_ids)``. Reused blocks count as
        committed; the caller computes only tokens ``[num_cached_tokens, len(prompt))``.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already active")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if not 1 <= beam_width <= self.max_beam_width:
            raise ValueError(f"beam_width = {beam_width} outside [1, {self.max_beam_width}]")
        if num_encoder_tokens < 0:
            raise ValueError(f"num_encoder_tokens must be >= 0, got {num_encoder_tokens}")
        bs = self.block_size
        num_prompt = len(prompt)
        self._check_len("len(prompt_token_ids)", num_prompt)
        num_cross = self._check_len("num_encoder_tokens", num_encoder_tokens)
        cacheable = self.enable_prefix_caching and num_encoder_tokens == 0
        hits = self._match_prefix(prompt) if cacheable else ([], [])
        num_hits = len(hits[0])
        num_full = num_prompt // bs
        has_tail = num_prompt % bs != 0
        need = []
        for p, pool in enumerate(self.pools):
            hit_blocks = {blocks[p] for blocks in hits[1]}
            num_free_hits = sum(pool.is_free(b) for b in hit_blocks)
            need.append((num_full - num_hits) + beam_width * has_tail + num_cross + num_free_hits)
        short = self._shortfall(need)
        if short is not None:
            return short
        if self.num_state_slots and not self._free_slots:
            return AllocationResult(False, 0, 0, "state_slots", (0,) * self.num_pools)

        req = self._new_request(request_id, prompt, beam_width, num_encoder_tokens, cacheable)
        for p, pool in enumerate(self.pools):
            shared = [blocks[p] for blocks in hits[1]]
            pool.touch(shared * beam_width)
            fresh = pool.allocate(num_full - num_hits)
            pool.touch(fresh * (beam_width - 1))
            shared += fresh
            for beam in range(beam_width):
                tail = pool.allocate(1) if has_tail else []
                self._set_blocks(p, req.rows[beam], shared + tail)
            if num_cross:
                self._set_cross_blocks(p, req.rows[0], pool.allocate(num_cross))
        self._num_committed[req.rows[0]] = num_hits * bs
        req.hashes = list(hits[0])
        if cacheable:
            self._num_queried_tokens += num_prompt
            self._num_hit_tokens += num_hits * bs
        return AllocationResult(True, num_hits * bs)

    def _match_prefix(self, prompt: list[int]) -> tuple[list[bytes], list[list[int]]]:
        """Longest run of cached full blocks (in every pool), leaving >= 1 token to compute."""
        bs = self.block_size
        hashes: list[bytes] = []
        blocks: list[list[int]] = []
        parent = None
        for b in range((len(prompt) - 1) // bs):
            parent = hash_block_tokens(parent, prompt[b * bs : (b + 1) * bs])
            found = [pool.lookup(parent) for pool in self.pools]
            if any(x is None for x in found):
                break
            hashes.append(parent)
            blocks.append(found)
        return hashes, blocks

    def extend(self, request_id: Hashable, num_tokens: int) -> AllocationResult:
        """Grow the logical length by ``num_tokens`` (every beam), allocating as needed."""
        req = self._get(request_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        row0 = req.rows[0]
        total = int(self._num_tokens[row0]) + num_tokens
        result = self._grow_to(req, total, "num_tokens")
        if result.ok:
            self._num_tokens[row0] = total
        return result

    def reserve(self, request_id: Hashable, num_extra_tokens: int) -> AllocationResult:
        """Make blocks exist for ``num_extra_tokens`` past the logical length (every beam).

        The logical length does not change: the new blocks are *reserved* (addressable for
        speculative appends; not part of the sequence until ``extend`` covers them).
        """
        req = self._get(request_id)
        if num_extra_tokens < 0:
            raise ValueError(f"num_extra_tokens must be >= 0, got {num_extra_tokens}")
        total = int(self._num_tokens[req.rows[0]]) + num_extra_tokens
        return self._grow_to(req, total, "num_tokens + num_extra_tokens")

    def _grow_to(self, req, total_tokens: int, name: str) -> AllocationResult:
        want = self._check_len(name, total_tokens)
        have = int(self._num_allocated[req.rows[0]])
        extra = max(0, want - have)
        if extra == 0:
            return ALLOCATED
        short = self._shortfall([extra * req.beam_width] * self.num_pools)
        if short is not None:
            return short
        for row in req.rows:
            self._append_blocks(row, [pool.allocate(extra) for pool in self.pools])
        return ALLOCATED

    def rewind(self, request_id: Hashable, num_tokens: int) -> None:
        """Shrink the logical length by ``num_tokens`` (rejected draft tokens).

        Their blocks stay allocated (now reserved). Committed tokens cannot be rewound.
        """
        row0 = self._get(request_id).rows[0]
        uncommitted = int(self._num_tokens[row0] - self._num_committed[row0])
        if not 0 <= num_tokens <= uncommitted:
            raise ValueError(
                f"rewind num_tokens = {num_tokens} outside [0, {uncommitted}] (uncommitted "
                f"tokens of {request_id!r})"
            )
        self._num_tokens[row0] -= num_tokens

    def release_reserved(self, request_id: Hashable) -> int:
        """Free every block past the logical blocks (all beams); returns blocks freed per beam."""
        req = self._get(request_id)
        keep = _cdiv(int(self._num_tokens[req.rows[0]]), self.block_size)
        have = int(self._num_allocated[req.rows[0]])
        for row in req.rows:
            for pool, removed in zip(self.pools, self._truncate_blocks(row, keep)):
                pool.free([b for b in reversed(removed) if b])  # skip released holes
        return max(0, have - keep)

    def commit_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record that the K/V of ``token_ids`` is written; they follow the committed prefix.

        Pass prompt tokens chunk by chunk as prefill computes them (they must equal the
        prompt), then each generated token once its K/V is written. Committed tokens never
        exceed the logical length. Full committed blocks get hashed for prefix reuse (for
        beam_width > 1 only the shared prompt blocks; none for cross-attention requests).
        """
        req = self._get(request_id)
        row0 = req.rows[0]
        token_ids = [int(t) for t in token_ids]
        start = int(self._num_committed[row0])
        end = start + len(token_ids)
        if end > self._num_tokens[row0]:
            raise ValueError(
                f"request {request_id!r}: committing {len(token_ids)} tokens after {start} "
                f"exceeds the logical length {int(self._num_tokens[row0])}"
            )
        overlap = req.prompt[start:end]
        if token_ids[: len(overlap)] != overlap:
            raise ValueError(
                f"request {request_id!r}: committed tokens at [{start}, {end}) differ from "
                "the prompt"
            )
        self._append_committed(req, start, token_ids)
        if self.release_out_of_window:
            self._release_out_of_window(req)

    def free(self, request_id: Hashable) -> None:
        """Release every block of the request (tail blocks first, so prefixes stay cached)."""
        req = self._get(request_id)
        for row in req.rows:
            for pool, removed in zip(self.pools, self._truncate_blocks(row, 0)):
                pool.free([b for b in reversed(removed) if b])  # skip released holes
        for pool, cross in zip(self.pools, self._take_cross_blocks(req.rows[0])):
            pool.free(cross[::-1])
        self._drop_request(request_id)

    def _append_committed(self, req: Request, start: int, token_ids: list[int]) -> None:
        """Commit ``token_ids`` at positions ``start ..`` of ``req``: keep the last partial
        block's tokens in ``_tail`` and hash each block they fill (``_block_filled``)."""
        bs = self.block_size
        row0 = req.rows[0]
        tail = self._tail[row0]
        n = len(token_ids)
        b, off = divmod(start, bs)
        i = 0
        while i < n:
            take = min(bs - off, n - i)
            if take == bs:  # a whole block inside token_ids
                block = token_ids[i : i + bs]
            else:
                tail[off : off + take] = token_ids[i : i + take]
                block = tail
            i += take
            if off + take == bs:
                self._block_filled(req, b, block)
            b, off = b + 1, 0
        self._num_committed[row0] = start + n

    def _block_filled(self, req: Request, b: int, tokens: Sequence[int]) -> None:
        """Block ``b`` of ``req`` is now fully committed with ``tokens`` ([block_size]):
        hash it and offer it to the prefix cache (only the shared prompt blocks for
        beam_width > 1; never for cross-attention requests)."""
        if not req.cacheable or (req.beam_width > 1 and b >= len(req.prompt) // self.block_size):
            return  # later blocks differ per beam
        assert b == len(req.hashes), f"block {b} filled with {len(req.hashes)} blocks hashed"
        h = hash_block_tokens(req.hashes[-1] if req.hashes else None, tokens)
        row = req.rows[0]
        for p, pool in enumerate(self.pools):
            block = int(self._tables[p, row, b])
            if block:  # 0: already released out of the window
                pool.cache_block(block, h)
        req.hashes.append(h)

    def _release_out_of_window(self, req) -> None:
        """Free the leading blocks of window pools that no future query can see.

        Future queries sit at positions >= c = committed tokens and see keys >= p - W + 1, so
        block b is dead once its last position (b + 1) * bs - 1 < c - W + 1.
        """
        bs = self.block_size
        for p, (pool, window) in enumerate(zip(self.pools, self.window_sizes)):
            if window is None:
                continue
            num_dead = max(0, int(self._num_committed[req.rows[0]]) - window + 1) // bs
            for row in req.rows:
                dead = self._tables[p, row, :num_dead]
                blocks = dead[dead != 0].tolist()
                if blocks:
                    pool.free(blocks[::-1])
                    dead[:] = 0

    def beam_fork_copies(self, request_id: Hashable) -> list[tuple[int, int, int]]:
        """``(pool, src_block, dst_block)`` copies giving beams 1.. the prompt's partial block.

        The context step writes the partial last prompt block of beam 0 only; copy it into
        each other beam's own block (all layers) before their first generation step.
        """
        req = self._get(request_id)
        num_prompt = len(req.prompt)
        if req.beam_width == 1 or num_prompt % self.block_size == 0:
            return []
        j = num_prompt // self.block_size
        src_row = req.rows[0]
        return [
            (p, int(self._tables[p, src_row, j]), int(self._tables[p, row, j]))
            for p in range(self.num_pools)
            for row in req.rows[1:]
        ]
