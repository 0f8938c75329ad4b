"""Ragged page-table backend (FlashInfer-style): indices / indptr / last_page_len.

``prepare()`` turns the manager's block table into the three-piece ragged page table::

    num_blocks        = [3, 1, 2]                     pages exposed per sequence
    paged_kv_indices  = [7, 3, 9 | 4 | 12, 5]         flat, no holes
    paged_kv_indptr   = [0, 3, 4, 6]                  sequence b: indices[indptr[b]:indptr[b+1]]
    paged_kv_last_page_len = [2, 4, 1]                valid tokens in each last logical page

plus ``qo_indptr`` (the prefix sum of ``seq_lens`` in a preallocated device buffer), separate
``paged_kv_indptr_prefill`` (context rows) and ``paged_kv_indptr_decode`` (generation rows,
relative to ``indptr[num_contexts]``), and ``batch_indices`` / ``positions`` of the new tokens
(which sequence, which absolute position), from which the store slots are derived. All length
math is numpy on the host (every consumer needs host values; a device computation would cost
a sync per step); the device buffers are preallocated at capacity and filled by one staged copy.
With ``expand_on_device`` (the default on a GPU) the host stages only per-row facts (the rows'
block-table columns, ``indptr``, ``cached``) and one kernel writes ``paged_kv_indices`` and the
per-token ``slots`` / ``positions`` / ``batch_indices`` (``kvplan.backends.staging.expand``);
the ``*_np`` host copies of those are then recomputed with numpy on first read.

``qo_indptr`` is staged from the host's ``cu_seqlens_q`` (every backend needs it) with the
other fields rather than computed by a device cumsum after the copy: same values, same
stable buffer, one kernel launch less per step.

Addressable vs valid: with ``use_full_generation_page_table`` the generation rows
expose every reserved page (``max(logical, reserved)``) so a speculative append stays
addressable across a page boundary, while attention and positions use the separate logical
lengths ``kv_lens`` (``cached + seq_lens_kv``): the kernels are always given ``kv_lens``, never
a length derived from the wider table.

VSWA: one ``paged_kv_indices`` per pool (same ``num_blocks`` and indptr: every pool holds the
whole sequence); a layer reads its pool's indices. ``check_page_table`` cross-checks
logical blocks, exposed blocks and lengths after each ``prepare()``, reporting at most
``page_table_check_budget`` problems (then staying quiet) instead of raising.

Quantized caches (fp8, fp4) need nothing more here: the kernels read their pages in place
through the same page list (``kvplan.backends.page_table_attention``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvplan.backends.block_tables import (
    flat_page_index,
    gather_rows,
    new_token_positions,
)
from kvplan.backends.fresh_prefill import first_fresh_row
from kvplan.backends.lengths import CUMSUM, MAX, SUM
from kvplan.backends.page_table_attention import PagedSegment, PagedView, PageTableAttention
from kvplan.backends.page_table_check import page_table_problems
from kvplan.backends.paged_metadata import PagedMetadata
from kvplan.backends.staging import DeviceArena, DeviceExpander

logger = logging.getLogger(__name__)


class RaggedAttentionMetadata(PagedMetadata):
    """Ragged page-table metadata (see the module docstring).

    Extra args:
        use_full_generation_page_table: expose reserved pages of generation rows.
        check_page_table: run the self-check after each ``prepare()`` (a debug aid: O(rows)
            host work per step; off by default, on in the tests).
        page_table_check_budget: most self-check reports this object emits.
        check_kernel_inputs: let the kernels validate their inputs (a device sync; tests).

    After ``prepare()`` (host, numpy int32): ``num_blocks_np``, ``logical_num_blocks_np``,
    ``paged_kv_indices_np[pool]``, ``paged_kv_indptr_np``, ``paged_kv_last_page_len_np``,
    ``batch_indices_np``, ``positions_np`` (the staged ones are views of this step's staging
    buffer: read them before the next ``prepare()``). Device views (capacity buffers, stable
    addresses):
    ``qo_indptr``, ``paged_kv_indices(pool)``, ``paged_kv_indptr``, ``paged_kv_indptr_prefill``,
    ``paged_kv_indptr_decode``, ``paged_kv_last_page_len``, ``kv_lens``, ``batch_indices``,
    ``positions``.
    """

    def __init__(
        self,
        *,
        use_full_generation_page_table: bool = False,
        check_page_table: bool = False,
        page_table_check_budget: int = 8,
        check_kernel_inputs: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.use_full_generation_page_table = use_full_generation_page_table
        self.check_page_table = check_page_table
        self.page_table_check_budget = page_table_check_budget
        self.check_kernel_inputs = check_kernel_inputs
        self.page_table_reports: list[str] = []
        s, t = self.max_num_sequences, self.max_num_tokens
        width = self._max_blocks_per_seq
        fields = {
            "seq_lens": s,
            "qo_indptr": s + 1,
            "indptr": s + 1,
            "indptr_decode": s + 1,
            "qo_indptr_decode": s + 1,
            "last_page_len": s,
            "kv_lens": s,
            "batch_indices": t,
            "positions": t,
        }
        for p in range(self._num_pools):
            fields[f"slots{p}"] = t
        fields["cached"] = s  # per-row facts the device expands tokens and pages from
        for p in range(self._num_pools):  # the step's table rows, [n, max pages] (row stride)
            fields[f"table{p}"] = s * width
        for p in range(self._num_pools):
            fields[f"indices{p}"] = s * width
        # cross attention only: last, so other steps stage (and copy) a shorter prefix
        fields.update({"tok_page_start": t, "tok_kv_lens": t})
        self.arena = DeviceArena(fields, self.device)
        self._offsets = self.arena.offsets
        self._seq_lens_gpu = self.arena.view("seq_lens")  # staged with the other fields
        self.qo_indptr = self.arena.view("qo_indptr")  # [s + 1], staged from cu_seqlens_q
        self._flat_arange = np.arange(s * width, dtype=np.int64)  # int64: the take's index type
        self._positions_np = self._batch_indices_np = self._indices_np = None
        # 0, 1, ...: the page ids of a context-only batch without a cache (device int32 [t])
        self.token_arange = torch.arange(t, dtype=torch.int32, device=self.device)

    # device views -------------------------------------------------------------------
    def paged_kv_indices(self, pool: int = 0) -> torch.Tensor:
        return self.arena.view(f"indices{pool}")[: self._num_indices]

    @property
    def paged_kv_indptr(self) -> torch.Tensor:
        return self.arena.view("indptr")[: self.num_seqs + 1]

    @property
    def paged_kv_indptr_prefill(self) -> torch.Tensor:
        """Context rows' indptr: the first ``num_contexts + 1`` entries of ``paged_kv_indptr``."""
        return self.arena.view("indptr")[: self.num_contexts + 1]

    @property
    def paged_kv_indptr_decode(self) -> torch.Tensor:
        return self.arena.view("indptr_decode")[: self.num_generations + 1]

    @property
    def paged_kv_last_page_len(self) -> torch.Tensor:
        return self.arena.view("last_page_len")[: self.num_seqs]

    @property
    def kv_lens(self) -> torch.Tensor:
        """Logical KV lengths (device): what attention and positions use."""
        return self.arena.view("kv_lens")[: self.num_seqs]

    @property
    def batch_indices(self) -> torch.Tensor:
        return self.arena.view("batch_indices")[: self.num_kv_tokens]

    @property
    def positions(self) -> torch.Tensor:
        return self.arena.view("positions")[: self.num_kv_tokens]

    def slot_mapping(self, pool: int = 0) -> torch.Tensor:
        return self.arena.prefix(f"slots{pool}", self._num_kv_tokens)

    # prepare ------------------------------------------------------------------------
    def _prepare_backend(self) -> None:
        n, nc = self._num_seqs, self._num_contexts
        self._num_indices = 0
        self._positions_np = self._batch_indices_np = self._indices_np = None
        mgr = self.kv_cache_manager
        if mgr is None:
            self._stage_context_only(
                {"qo_indptr": self.cu_seqlens_q_np, "kv_lens": self.kv_lens_np}
            )
            return
        bs, cross, num_pools = self._block_size, self.is_cross, self._num_pools
        kv_lens, seq_lens_kv = self.kv_lens_np, self._kv_np
        # validate everything before staging starts (a CPU arena is written in place)
        decode = self.one_kv_token_per_row and self.decode_fast_path
        # the device expands the page list and the new tokens' fields from the table rows;
        # the host keeps cross steps (their K/V tokens are not the queries' rows)
        on_device = self.expand_on_device and not cross
        step = self._step_rows(decode=decode, per_token=not on_device)
        bt, pools, logical_nb = step.tables, step.pools, step.num_needed
        if self.use_full_generation_page_table and not cross:
            # context rows stay logical; generation rows expose every reserved page
            num_blocks = logical_nb.copy()
            np.maximum(logical_nb[nc:], bt.num_allocated[bt.rows[nc:]], out=num_blocks[nc:])
        else:
            num_blocks = logical_nb
        # the device path reads the page count off indptr (no extra reduction)
        num_indices = int(SUM(num_blocks)) if n and not on_device else 0
        arena = self.arena
        width = int(MAX(num_blocks)) if on_device and n else 0  # row stride of the table
        if cross:
            end = arena.end_of("tok_kv_lens", self._num_tokens)
        elif on_device:
            end = self._offsets[f"table{num_pools - 1}"] + n * width
        else:
            end = self._offsets[f"indices{num_pools - 1}"] + num_indices
        # Fields are written at their arena offsets (``o``) straight into the staging
        # buffer; every size is within its capacity: n <= max_num_sequences (seq_lens
        # setter), T <= max_num_tokens (_prepare_common), num_indices <= n * width (checked).
        o, T = self._offsets, self._num_kv_tokens
        host = arena.begin(end)
        self._put_seq_lens(host, o["seq_lens"])
        cu_q = self.cu_seqlens_q_np
        host[o["qo_indptr"] : o["qo_indptr"] + n + 1] = cu_q
        indptr = host[o["indptr"] : o["indptr"] + n + 1]
        indptr[0] = 0
        CUMSUM(num_blocks, out=indptr[1:])
        if on_device:
            num_indices = int(indptr[n])
        a = o["indptr_decode"]
        if nc:
            np.subtract(indptr[nc:], indptr[nc], out=host[a : a + n - nc + 1])
            a = o["qo_indptr_decode"]
            np.subtract(cu_q[nc:], np.int32(self._num_ctx_tokens), out=host[a : a + n - nc + 1])
        else:  # the decode indptrs are the whole batch's
            host[a : a + n + 1] = indptr
            host[o["qo_indptr_decode"] : o["qo_indptr_decode"] + n + 1] = cu_q
        last_page_len = host[o["last_page_len"] : o["last_page_len"] + n]
        if decode:  # position cached is the last token: (cached % bs) + 1 in its page
            np.add(step.in_block, 1, out=last_page_len)
        else:
            np.multiply(np.maximum(logical_nb - 1, 0), np.int32(bs), out=last_page_len)
            np.subtract(kv_lens, last_page_len, out=last_page_len)
        host[o["kv_lens"] : o["kv_lens"] + n] = kv_lens
        # new K/V tokens: which sequence, which absolute position, which slot
        # decode rows too: the kernel launches for the pages anyway, and writing each row's
        # slot / position / index there is cheaper than three more host passes
        if on_device:
            host[o["cached"] : o["cached"] + n] = self.cached_np
        else:
            positions = step.positions
            rows = self._arange[:n] if decode else self._arange[:n].repeat(seq_lens_kv)
            host[o["batch_indices"] : o["batch_indices"] + T] = rows
            host[o["positions"] : o["positions"] + T] = positions
            for p in range(num_pools):
                step.write_slots(p, bs, host[o[f"slots{p}"] : o[f"slots{p}"] + T])
            self._batch_indices_np, self._positions_np = rows, positions
        if on_device:  # the rows' first `width` columns, [n, width] per pool
            for p in range(num_pools):
                a = o[f"table{p}"]
                gather_rows(bt, p, host[a : a + n * width].reshape(n, width), width=width)
        else:
            flat_index = flat_page_index(pools[0].row_start, indptr, num_blocks, self._flat_arange)
            indices = []
            for p, t in enumerate(pools):
                idx = host[o[f"indices{p}"] : o[f"indices{p}"] + num_indices]
                t.flat.take(flat_index, out=idx, mode="clip")  # in range: rows own these columns
                indices.append(idx)
            self._indices_np = indices
        if cross:  # one decode "sequence" per query token
            q_rows = self._arange[:n].repeat(self._seq_lens_np)
            arena.put(host, "tok_page_start", indptr[q_rows])
            arena.put(host, "tok_kv_lens", kv_lens[q_rows])
        arena.commit()
        if on_device:  # keyed by the row stride (at most max_blocks_per_seq + 1 of them)
            self._expand_on_device(width)
        self._num_indices = num_indices
        self.num_blocks_np, self.logical_num_blocks_np = num_blocks, logical_nb
        self.paged_kv_indptr_np = indptr
        self.paged_kv_last_page_len_np = last_page_len
        if self.check_page_table:
            self._self_check(bs)

    _expand_token_rows = True  # positions and batch indices too

    def _bind_expansion(self, expander: DeviceExpander, width: int) -> tuple:
        """The page list and the new tokens' slots, positions and batch indices from
        ``indptr`` / ``qo_indptr`` / ``cached`` and the ``[n, width]`` table rows."""
        o = self._offsets
        pool_stride = self.max_num_sequences * self._max_blocks_per_seq
        return expander.bind(
            tokens=True, pages=True, cu_off=o["qo_indptr"], cached_off=o["cached"],
            table_off=o["table0"], table_pool_stride=pool_stride, row_stride=width,
            slots_off=o["slots0"], slots_pool_stride=self.max_num_tokens,
            pos_off=o["positions"], bidx_off=o["batch_indices"], indptr_off=o["indptr"],
            indices_off=o["indices0"], indices_pool_stride=pool_stride,
            block_size=self._block_size,
        )  # fmt: skip

    # host copies of the expanded fields -------------------------------------------
    # After a step the device expanded, these are recomputed with numpy on first read from
    # the same per-row facts (tests hold them equal to the device fields).
    @property
    def batch_indices_np(self) -> np.ndarray:
        if self._batch_indices_np is None:
            n = self._num_seqs
            self._batch_indices_np = self._arange[:n].repeat(self._kv_np)
        return self._batch_indices_np

    @property
    def positions_np(self) -> np.ndarray:
        if self._positions_np is None:
            self._positions_np = new_token_positions(
                self.cached_np, self.cu_seqlens_kv_np, self._kv_np, self._arange
            )
        return self._positions_np

    @property
    def paged_kv_indices_np(self) -> list[np.ndarray]:
        """Per pool, host int32 ``[num_indices]``: the step's ragged page list."""
        if self._indices_np is None:
            pools = self._pools  # this step's (set by _step_rows)
            flat_index = flat_page_index(
                pools[0].row_start, self.paged_kv_indptr_np, self.num_blocks_np,
                self._flat_arange,
            )  # fmt: skip
            self._indices_np = [t.flat.take(flat_index, mode="clip") for t in pools]
        return self._indices_np

    def _self_check(self, block_size: int) -> None:
        if self.page_table_check_budget <= 0:
            return
        problems = page_table_problems(
            self.kv_lens_np, self.logical_num_blocks_np, self.num_blocks_np,
            self.paged_kv_indptr_np, self.paged_kv_last_page_len_np,
            self.paged_kv_indices_np[0].size, block_size,
        )  # fmt: skip
        for msg in problems[: self.page_table_check_budget]:
            self.page_table_check_budget -= 1
            self.page_table_reports.append(msg)
            logger.warning("ragged page table self-check: %s", msg)

    # kernel view --------------------------------------------------------------------
    def paged_view(self, pool: int) -> PagedView:
        """The kernels' view of pool ``pool``: its page list, ``paged_kv_indptr`` the row
        starts (the generation segment's relative to ``indptr[num_contexts]``)."""
        n, nc, ng = self.num_seqs, self.num_contexts, self.num_generations
        indices = self.paged_kv_indices(pool)
        kv_lens = self.kv_lens
        q_lens = self._seq_lens_np
        max_kv = int(self.kv_lens_np.max()) if n else 0
        if self.is_cross:
            t = self.num_tokens
            seg = PagedSegment(
                indices, self.arena.view("tok_page_start")[:t],
                self.arena.view("tok_kv_lens")[:t], None, t, 1, max_kv,
            )  # fmt: skip
            return PagedView(seg, None, cross=True)
        ctx = gen = None
        if nc:
            ctx = PagedSegment(
                indices, self.paged_kv_indptr[:nc], kv_lens[:nc], self.qo_indptr[: nc + 1],
                self.num_ctx_tokens, int(q_lens[:nc].max()), max_kv,
                self.cu_seqlens_q_np[: nc + 1], first_fresh_row(self.cached_np[:nc]),
            )  # fmt: skip
        if ng:
            # the decode segment's pages start at indptr[nc]; its own indptr is relative
            gen_ids = indices[int(self.paged_kv_indptr_np[nc]) :]
            max_q = int(q_lens[nc:].max())
            cu = self.arena.view("qo_indptr_decode")[: ng + 1] if max_q > 1 else None
            gen = PagedSegment(
                gen_ids, self.paged_kv_indptr_decode[:ng], kv_lens[nc:n], cu,
                self.num_tokens - self.num_ctx_tokens, max_q, max_kv,
            )  # fmt: skip
        return PagedView(ctx, gen)


class RaggedAttention(PageTableAttention):
    """Paged kernels reading the ragged page table (see the module docstring)."""

    name = "ragged"
    Metadata = RaggedAttentionMetadata
