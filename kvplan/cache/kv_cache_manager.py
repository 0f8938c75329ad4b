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
  a window pool frees the blocks no future query can see and leaves block 0 in their place,
  and allocates only the blocks a query can see: at admission those of the first chunk
  (``add_request(..., max_new_tokens=...)``), later ones by ``prepare_chunk`` or ``extend``
  (``BlockAllocator``'s docstring states the rule, prefix hits included).
* beams: the prompt's full blocks are shared by all beams (one reference per beam); the
  prompt's partial last block and all later blocks are per beam. Only beam 0's partial prompt
  block is written by the context step; ``beam_fork_copies`` lists the copies that give the
  other beams that content.
* cross attention: ``num_encoder_tokens > 0`` gives the request its own encoder blocks in every
  pool, shared by its beams.

Running out of blocks (or state slots) returns ``AllocationResult(ok=False, ...)`` and changes
nothing; caller errors (unknown id, double free, a sequence longer than
``max_blocks_per_seq`` blocks) raise ``ValueError``.

The manager fronts parts it owns (``pools``, ``requests``, ``allocator``, ``prefix_cache``,
``decode_step``, ``batch_views``); ``kvplan.cache``'s docstring says what each one holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvplan._math import cdiv
from kvplan.cache.allocation_result import ALLOCATED, AllocationResult, BatchAllocationResult
from kvplan.cache.batch_tables import BatchTables
from kvplan.cache.batch_views import BatchTableViews
from kvplan.cache.block_allocator import BlockAllocator
from kvplan.cache.block_offsets import BlockOffsetsStager, CopyFn
from kvplan.cache.block_pool import BlockPool
from kvplan.cache.cache_config import KVCacheConfig
from kvplan.cache.decode_step import DecodeStepUpdates
from kvplan.cache.prefix_cache import PrefixCache, PrefixCacheStats, PrefixMatch
from kvplan.cache.request_table import RequestTable

if TYPE_CHECKING:
    import torch

__all__ = ["AllocationResult", "BatchAllocationResult", "KVCacheManager", "PrefixCacheStats"]


def int_list(values: Sequence[int]) -> list[int]:
    """``values`` as a new list of Python ints: a list of plain ints is copied after one
    C-level type scan (~4x cheaper than converting 8,000 tokens one by one)."""
    if type(values) is list and set(map(type, values)) <= {int}:
        return values.copy()
    return [int(t) for t in values]


class KVCacheManager:
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
            nonzero entries. Such pools also allocate lazily (``prepare_chunk``). Off by
            default.
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
        cfg = KVCacheConfig(
            num_blocks, block_size, max_blocks_per_seq, window_sizes, layer_to_pool,
            enable_prefix_caching, num_state_slots, max_beam_width, release_out_of_window,
        )  # fmt: skip
        self.config = cfg
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = cfg.max_seq_len
        self.window_sizes = window_sizes = tuple(window_sizes)
        self.num_pools = num_pools = cfg.num_pools
        self.enable_prefix_caching = enable_prefix_caching
        self.release_out_of_window = release_out_of_window
        self.max_beam_width = max_beam_width
        self.num_state_slots = num_state_slots
        self.layer_to_pool = cfg.pool_of_layer
        self.pools = [
            BlockPool(n, enable_prefix_caching=enable_prefix_caching) for n in cfg.blocks_per_pool
        ]
        self.requests = RequestTable(num_pools, max_blocks_per_seq, num_state_slots, block_size)
        self.allocator = BlockAllocator(
            self.pools,
            window_sizes,
            self.requests,
            block_size,
            max_blocks_per_seq,
            windowed=release_out_of_window,
        )
        self.prefix_cache = PrefixCache(
            self.pools, self.requests, block_size, window_sizes if release_out_of_window else None
        )
        self.decode_step = DecodeStepUpdates(
            self.requests, self.allocator, self.prefix_cache, release_out_of_window
        )
        self.batch_views = BatchTableViews(self.requests, max_blocks_per_seq)

    @classmethod
    def from_layer_windows(
        cls,
        num_blocks: int | Sequence[int],
        block_size: int,
        layer_windows: Sequence[int | None],
        **kwargs,
    ) -> KVCacheManager:
        """One pool per distinct window of ``layer_windows`` (in first-seen order)."""
        windows, layer_to_pool = KVCacheConfig.layer_windows_to_pools(layer_windows)
        return cls(
            num_blocks, block_size, window_sizes=windows, layer_to_pool=layer_to_pool, **kwargs
        )

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
        return self.prefix_cache.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay allocated; blocks completed by later
        commits are hashed as usual."""
        self.prefix_cache.reset()

    def num_free_blocks(self, pool: int = 0) -> int:
        return self.pools[self.requests.check_pool(pool)].num_free_blocks

    def can_allocate(self, num_tokens: int, pool: int = 0) -> bool:
        """Whether a new single-beam sequence of ``num_tokens`` tokens fits in ``pool`` now."""
        return cdiv(num_tokens, self.block_size) <= self.num_free_blocks(pool)

    # ------------------------------------------------------------------ lifecycle
    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        *,
        beam_width: int = 1,
        num_encoder_tokens: int = 0,
        reuse_prefix: bool = True,
        max_new_tokens: int | None = None,
        wait_for_pending: bool = False,
    ) -> AllocationResult:
        """Allocate blocks for the whole prompt, reusing cached full prefix blocks.

        The logical length becomes ``len(prompt_token_ids)``. Reused blocks count as
        committed; the caller computes only tokens ``[num_cached_tokens, len(prompt))``.
        ``reuse_prefix=False``: reuse no cached block (every token is computed); the
        request's own full blocks are still hashed for others.
        ``max_new_tokens``: the first chunk computes at most this many tokens; with
        ``release_out_of_window`` the window pools allocate only what that chunk's queries
        see (``prepare_chunk`` adds the rest chunk by chunk). None: the whole prompt.
        ``wait_for_pending``: when the blocks right after the cached run are ones another
        admitted request has yet to commit (its prefill is computing them), allocate nothing
        and return ``reason="pending_prefix"`` with ``num_shared_tokens`` = the end of that
        run and ``pending_owner`` = that request: admitted once they are committed, this
        prompt reuses them instead of computing them again.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already active")
        prompt = int_list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if not 1 <= beam_width <= self.max_beam_width:
            raise ValueError(f"beam_width = {beam_width} outside [1, {self.max_beam_width}]")
        if num_encoder_tokens < 0:
            raise ValueError(f"num_encoder_tokens must be >= 0, got {num_encoder_tokens}")
        num_prompt = len(prompt)
        self.allocator.num_blocks_for("len(prompt_token_ids)", num_prompt)
        num_cross = self.allocator.num_blocks_for("num_encoder_tokens", num_encoder_tokens)
        cacheable = self.enable_prefix_caching and num_encoder_tokens == 0
        lookup = cacheable and reuse_prefix
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        hit_hashes, hit_blocks, shared = [], [], 0
        if lookup:
            m = self.prefix_cache.match_runs(prompt, pending=wait_for_pending)
            if m.pending_end:
                return self._pending_result(m)
            hit_hashes, hit_blocks, shared = m.hashes, m.blocks, m.num_shared
        end = None
        if max_new_tokens is not None:
            end = len(hit_blocks) * self.block_size + max_new_tokens
        alloc = self.allocator
        short = alloc.prompt_shortfall(num_prompt, hit_blocks, beam_width, num_cross, end)
        if short is not None:
            return short
        if self.num_state_slots and not self.requests.has_free_state_slot():
            return AllocationResult(False, 0, 0, "state_slots", (0,) * self.num_pools)
        req = self.requests.add(request_id, prompt, beam_width, num_encoder_tokens, cacheable)
        alloc.allocate_prompt(req, hit_blocks, num_cross, end)
        num_cached = len(hit_hashes) * self.block_size
        self.requests.num_committed[req.rows[0]] = num_cached
        req.hashes = list(hit_hashes)
        if cacheable:
            self.prefix_cache.add_pending(req)
        if lookup:
            self.prefix_cache.record_lookup(num_prompt, num_cached)
        return AllocationResult(True, num_cached, num_shared_tokens=shared * self.block_size)

    def pending_prefix(self, prompt_token_ids: Sequence[int]) -> AllocationResult:
        """What ``add_request(..., wait_for_pending=True)`` would answer about pending blocks,
        changing nothing: ``reason="pending_prefix"`` with ``num_shared_tokens`` and
        ``pending_owner`` when the blocks after the prompt's cached run are pending, else an
        ok result (whether the prompt would fit is not asked; no lookup while nothing is
        pending)."""
        if not self.prefix_cache.pending:
            return ALLOCATED
        m = self.prefix_cache.match_runs(prompt_token_ids, pending=True)
        return self._pending_result(m) if m.pending_end else ALLOCATED

    def _pending_result(self, m: PrefixMatch) -> AllocationResult:
        """The "pending_prefix" answer of a lookup ``m`` (a `PrefixMatch` with pending
        blocks)."""
        return AllocationResult(False, reason="pending_prefix", pending_owner=m.owner,
                                num_shared_tokens=m.pending_end * self.block_size)  # fmt: skip

    def extend(self, request_id: Hashable, num_tokens: int) -> AllocationResult:
        """Grow the logical length by ``num_tokens`` (every beam), allocating as needed."""
        req = self.requests.get(request_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        row0 = req.rows[0]
        total = int(self.requests.num_tokens[row0]) + num_tokens
        result = self.allocator.grow_to(req, total, "num_tokens")
        if result.ok:
            self.requests.num_tokens[row0] = total
        return result

    def prepare_chunk(self, request_id: Hashable, end_tokens: int) -> AllocationResult:
        """Make the window pools hold every block that queries at positions ``[committed,
        end_tokens)`` can see (only allocated columns; a no-op without
        ``release_out_of_window``). Call it before computing a prefill chunk that ends at
        ``end_tokens``; a failed result changes nothing."""
        req = self.requests.get(request_id)
        if end_tokens < 0:
            raise ValueError(f"end_tokens must be >= 0, got {end_tokens}")
        return self.allocator.materialize(req, end_tokens)

    def reserve(self, request_id: Hashable, num_extra_tokens: int) -> AllocationResult:
        """Make blocks exist for ``num_extra_tokens`` past the logical length (every beam).

        The logical length does not change: the new blocks are *reserved* (addressable for
        speculative appends; not part of the sequence until ``extend`` covers them).
        """
        req = self.requests.get(request_id)
        if num_extra_tokens < 0:
            raise ValueError(f"num_extra_tokens must be >= 0, got {num_extra_tokens}")
        total = int(self.requests.num_tokens[req.rows[0]]) + num_extra_tokens
        return self.allocator.grow_to(req, total, "num_tokens + num_extra_tokens")

    def rewind(self, request_id: Hashable, num_tokens: int) -> None:
        """Shrink the logical length by ``num_tokens`` (rejected draft tokens).

        Their blocks stay allocated (now reserved). Committed tokens cannot be rewound.
        """
        row0 = self.requests.get(request_id).rows[0]
        num_tokens_of = self.requests.num_tokens
        uncommitted = int(num_tokens_of[row0] - self.requests.num_committed[row0])
        if not 0 <= num_tokens <= uncommitted:
            raise ValueError(
                f"rewind num_tokens = {num_tokens} outside [0, {uncommitted}] (uncommitted "
                f"tokens of {request_id!r})"
            )
        num_tokens_of[row0] -= num_tokens

    def release_reserved(self, request_id: Hashable) -> int:
        """Free every block past the logical blocks (all beams); returns blocks freed per beam."""
        req = self.requests.get(request_id)
        row0 = req.rows[0]
        keep = cdiv(int(self.requests.num_tokens[row0]), self.block_size)
        have = int(self.requests.num_allocated[row0])
        self.allocator.truncate(req, keep)
        return max(0, have - keep)

    def commit_tokens(
        self, request_id: Hashable, token_ids: Sequence[int], *, release: bool = True
    ) -> None:
        """Record that the K/V of ``token_ids`` is written; they follow the committed prefix.

        Pass prompt tokens chunk by chunk as prefill computes them (they must equal the
        prompt), then each generated token once its K/V is written. Committed tokens never
        exceed the logical length. Full committed blocks get hashed for prefix reuse (for
        beam_width > 1 only the shared prompt blocks; none for cross-attention requests).
        With ``release_out_of_window``, the blocks that left the window are freed too;
        ``release=False`` leaves that to a later ``release_dead_blocks`` (a caller that
        commits ahead of its per-row loop keeps the order of the frees).
        """
        req = self.requests.get(request_id)
        row0 = req.rows[0]
        token_ids = int_list(token_ids)
        start = int(self.requests.num_committed[row0])
        end = start + len(token_ids)
        num_tokens = int(self.requests.num_tokens[row0])
        if end > num_tokens:
            raise ValueError(
                f"request {request_id!r}: committing {len(token_ids)} tokens after {start} "
                f"exceeds the logical length {num_tokens}"
            )
        overlap = req.prompt[start:end]
        if token_ids[: len(overlap)] != overlap:
            raise ValueError(
                f"request {request_id!r}: committed tokens at [{start}, {end}) differ from "
                "the prompt"
            )
        self.prefix_cache.commit(req, start, token_ids)
        if release and self.release_out_of_window:
            self.allocator.release_out_of_window(req)

    def release_dead_blocks(self, request_id: Hashable) -> None:
        """Free the request's window-pool blocks that no future query can see (what
        ``commit_tokens`` does after committing; for ``commit_tokens_many(...,
        release=False)``). A no-op without ``release_out_of_window`` or with nothing dead."""
        if self.release_out_of_window:
            self.allocator.release_out_of_window(self.requests.get(request_id))

    def free(self, request_id: Hashable) -> None:
        """Release every block of the request (tail blocks first, so prefixes stay cached)."""
        req = self.requests.get(request_id)
        self.allocator.truncate(req, 0)
        self.allocator.free_cross(req)
        self.prefix_cache.drop_pending(req)
        self.requests.drop(request_id)

    def beam_fork_copies(self, request_id: Hashable) -> list[tuple[int, int, int]]:
        """``(pool, src_block, dst_block)`` copies giving beams 1.. the prompt's partial block.

        The context step writes the partial last prompt block of beam 0 only; copy it into
        each other beam's own block (all layers) before their first generation step.
        """
        return self.allocator.beam_fork_copies(self.requests.get(request_id))

    # ------------------------------------------------------------------ per-request queries
    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self.requests

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def request_ids(self) -> list[Hashable]:
        """The active request ids, in the order they were added."""
        return list(self.requests)

    def num_tokens(self, request_id: Hashable) -> int:
        """Logical length (prompt + every extend - rewinds)."""
        return int(self.requests.num_tokens[self.requests.get(request_id).rows[0]])

    def num_committed_tokens(self, request_id: Hashable) -> int:
        return int(self.requests.num_committed[self.requests.get(request_id).rows[0]])

    def num_logical_blocks(self, request_id: Hashable) -> int:
        return cdiv(self.num_tokens(request_id), self.block_size)

    def num_allocated_blocks(self, request_id: Hashable) -> int:
        """Logical plus reserved blocks of each beam."""
        return int(self.requests.num_allocated[self.requests.get(request_id).rows[0]])

    def beam_width(self, request_id: Hashable) -> int:
        return self.requests.get(request_id).beam_width

    def get_block_ids(self, request_id: Hashable, pool: int = 0, *, beam: int = 0) -> list[int]:
        """All allocated blocks (logical and reserved) of one beam, in sequence order
        (block 0 where ``release_out_of_window`` freed a block)."""
        row = self.requests.row(request_id, beam)
        return self.requests.block_ids(self.requests.check_pool(pool), row)

    def get_block_ids_view(
        self, request_id: Hashable, pool: int = 0, *, beam: int = 0
    ) -> np.ndarray:
        """`get_block_ids` as a read-only int32 numpy view of the manager's table: no
        per-call list, so a step's host work does not grow with the context. Valid until the
        request's blocks next change (read it when the step is planned)."""
        row = self.requests.row(request_id, beam)
        return self.requests.block_ids_view(self.requests.check_pool(pool), row)

    def get_cross_block_ids(self, request_id: Hashable, pool: int = 0) -> list[int]:
        """The request's encoder blocks (shared by its beams)."""
        row = self.requests.get(request_id).rows[0]
        return self.requests.cross_block_ids(self.requests.check_pool(pool), row)

    def get_state_slot(self, request_id: Hashable) -> int:
        """The request's state slot (SWA ring); ValueError when the manager has none."""
        slot = self.requests.get(request_id).state_slot
        if slot is None:
            raise ValueError("this manager was built with num_state_slots = 0")
        return slot

    # ------------------------------------------------------------------ decode step (batched)
    def extend_many(
        self, request_ids: Sequence[Hashable], num_tokens: int | Sequence[int] | np.ndarray
    ) -> BatchAllocationResult:
        """``extend`` of each request in order, with numpy work over the batch
        (``DecodeStepUpdates.extend_many`` states the contract)."""
        return self.decode_step.extend_many(request_ids, num_tokens)

    def commit_tokens_many(
        self,
        request_ids: Sequence[Hashable],
        token_ids: Sequence[int] | np.ndarray,
        *,
        release: bool = True,
    ) -> np.ndarray:
        """``commit_tokens`` of one token per request; with ``release=False`` the window
        blocks that left the window stay for ``release_dead_blocks`` and the indices of
        their requests are returned (``DecodeStepUpdates.commit_tokens_many`` states the
        contract)."""
        return self.decode_step.commit_tokens_many(request_ids, token_ids, release=release)

    # ------------------------------------------------------------------ batch tables
    # Contracts (shapes, row rules, the staging rule) are stated on ``BatchTableViews``.
    def batch_tables(
        self, request_ids: Sequence[Hashable], beam_width: int = 1, num_contexts: int = 0,
        *, cross: bool = False,
    ) -> BatchTables:  # fmt: skip
        """The batch's rows of the block tables without copying any table (read-only views).

        Example (one pool, beam_width 1)::

            bt = m.batch_tables(["a", "b"])
            bt.tables[0, bt.rows]              # [2, max_blocks_per_seq] block ids
        """
        return self.batch_views.batch_tables(request_ids, beam_width, num_contexts, cross=cross)

    def get_block_ids_per_seq(
        self, request_ids: Sequence[Hashable], pool: int = 0, *,
        beams: Sequence[int] | None = None, width: int | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Block tables ``[n, width]`` int32 padded with block 0; ``beams[i]`` (default 0)
        picks the beam of ``request_ids[i]``."""
        return self.batch_views.get_block_ids_per_seq(request_ids, pool, beams, width)

    def get_batch_cache_indices(
        self, request_ids: Sequence[Hashable], layer_idx: int | None = None,
        num_blocks_per_seq: Sequence[int] | None = None, *, beams: Sequence[int] | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """Per-sequence block-id lists of ``layer_idx``'s pool."""
        pool = self.pool_for_layer(layer_idx)
        return self.batch_views.get_batch_cache_indices(
            request_ids, pool, num_blocks_per_seq, beams
        )

    def get_batch_cache_indices_flat(
        self, request_ids: Sequence[Hashable], num_blocks_per_seq: Sequence[int] | None = None,
        layer_idx: int | None = None, *, beams: Sequence[int] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """``get_batch_cache_indices`` concatenated into one int32 array (ragged indices)."""
        pool = self.pool_for_layer(layer_idx)
        views = self.batch_views
        return views.get_batch_cache_indices_flat(request_ids, pool, num_blocks_per_seq, beams)

    def copy_batch_block_offsets(
        self, dst, request_ids: Sequence[Hashable], beam_width: int, num_contexts: int,
        num_seqs: int, *, cross: bool = False, max_blocks: int | None = None,
        copy_fn: CopyFn | None = None,
    ):  # fmt: skip
        """Write this batch's block-offset rows into ``dst`` (int32 ``[num_pools, max_batch,
        2, max_blocks_per_seq]``, any device) through a private pinned snapshot (returned)."""
        return self.batch_views.copy_batch_block_offsets(
            dst, request_ids, beam_width, num_contexts, num_seqs,
            cross=cross, max_blocks=max_blocks, copy_fn=copy_fn,
        )  # fmt: skip

    def fill_host_block_offsets(
        self, request_ids: Sequence[Hashable], beam_width: int, num_contexts: int,
        num_seqs: int, *, max_batch: int, cross: bool = False,
    ) -> BlockOffsetsStager:  # fmt: skip
        """Fill the persistent host buffer for this batch; returns its stager."""
        return self.batch_views.fill_host_block_offsets(
            request_ids, beam_width, num_contexts, num_seqs, max_batch=max_batch, cross=cross
        )

    def host_block_offsets(self, max_batch: int, *, cross: bool = False) -> torch.Tensor:
        """The persistent host buffer of ``(cross, max_batch)`` (for synchronous readers)."""
        return self.batch_views.host_block_offsets(max_batch, cross=cross)
