"""Block-offsets backend (TensorRT-LLM-style): a fixed-width 4-D block table per step.

``prepare()`` asks the manager to fill ``kv_cache_block_offsets`` int32
``[num_pools, max_num_sequences, 2, max_blocks_per_seq]`` (dim 2: 0 = K, 1 = V; both hold the
block id, since K and V are separate tensors indexed by the same id) through
``KVCacheManager.copy_batch_block_offsets`` -- persistent host buffer for synchronous readers,
private pinned snapshot for the async copy. Rows: context requests one each (beam 0), then
generation requests ``beam_width`` each (cross attention repeats the request's encoder row).
The kernels read that table directly: pool p's pages of row b are
``table[p].flatten()[b * 2 * max_blocks_per_seq + j]`` (the K entries, used for both the K
and the V cache; the V entries are equal by construction and kept for the layout).

Lengths (addressable vs valid, seed 001):
    kv_lens       host int32 ``[num_seqs]`` = cached + seq_lens_kv + num_extra_kv_tokens: the
                  addressable bound (draft tokens a speculative sub-step may append on the
                  device); it sizes the table width and is checked against ``max_seq_len``.
    kv_lens_cuda  device int32 = cached + seq_lens_kv: the keys attention reads.
    host_total_kv_lens  ``[2]``: sum of kv_lens_cuda over context rows, generation rows.
    host_request_types  ``[max_num_sequences]`` int32 (0 = context, 1 = generation); allocated
                  uninitialized (``torch.empty``), filled by ``prepare()`` and also by
                  ``prepare_encoder_only()``.

Width: the copied columns are capped at ``ceil(max(kv_lens) / block_size)`` only when no
speculative path can advance lengths on the device (``num_extra_kv_tokens == 0`` and not
``is_spec_decoding_enabled``); otherwise the full ``max_blocks_per_seq`` width is copied, because
device-side sub-steps may dereference columns a host-derived cap would leave stale.

``enable_block_id_tables`` adds the MLA-style decode tables: ``kv_block_ids_per_seq``
``[max_num_sequences, max_blocks_per_seq]`` (all rows) and ``block_ids_per_seq`` (generation
rows first, so row g is generation sequence g), zero-filled then copied, skipped while a CUDA
graph is capturing; the generation segment's decode then reads ``block_ids_per_seq``.

fp8 caches (``kv_cache.is_quantized``, given at construction): ``prepare()`` also lists each
row's first ``ceil(kv_lens / block_size)`` blocks (draft tokens included) as a load plan, and
the forward reads a compact bf16 copy of just those pages (``kvplan.backends.paged``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan.backends.base import AttentionBackend
from kvplan.backends.host_arrays import MAX, MIN, SUM, as_int32_array, exclusive_cumsum
from kvplan.backends.ledger import (
    batch_block_table,
    check_allocated,
    decode_token_slots,
    logical_num_blocks,
    new_token_slots,
)
from kvplan.backends.metadata import AttentionMetadata
from kvplan.backends.paged import (
    PagedSegment,
    PagedView,
    attend_page_table,
    page_load_plan,
    stage_without_cache,
)
from kvplan.backends.staging import DeviceArena, to_device


class BlockOffsetsAttentionMetadata(AttentionMetadata):
    """Block-offset metadata (see the module docstring).

    Extra args:
        num_extra_kv_tokens: draft tokens past this step's tokens a speculative sub-step may
            append on the device (must have blocks: ``KVCacheManager.reserve``).
        is_spec_decoding_enabled: a speculative path may advance lengths on the device.
        enable_block_id_tables: also build the MLA-style block-id tables.
        check_kernel_inputs: let the kernels validate their inputs (a device sync; tests).
    """

    def __init__(
        self,
        *,
        num_extra_kv_tokens: int = 0,
        is_spec_decoding_enabled: bool = False,
        enable_block_id_tables: bool = False,
        check_kernel_inputs: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(num_extra_kv_tokens, int) or num_extra_kv_tokens < 0:
            raise ValueError(
                f"num_extra_kv_tokens must be an int >= 0, got {num_extra_kv_tokens!r}"
            )
        self.num_extra_kv_tokens = num_extra_kv_tokens
        self.is_spec_decoding_enabled = is_spec_decoding_enabled
        self.enable_block_id_tables = enable_block_id_tables
        self.check_kernel_inputs = check_kernel_inputs
        s, t = self.max_num_sequences, self.max_num_tokens
        mgr = self.kv_cache_manager
        self._num_pools = 1 if mgr is None else int(mgr.num_pools)
        width = 1 if mgr is None else int(mgr.max_blocks_per_seq)
        self.max_blocks_per_seq = width
        check_int32("num_pools * max_num_sequences * 2 * max_blocks_per_seq",
                    self._num_pools * s * 2 * width)  # fmt: skip
        dev = self.device
        self.kv_cache_block_offsets = torch.zeros(
            (self._num_pools, s, 2, width), dtype=torch.int32, device=dev
        )
        # row b's pages start at b * 2 * width in the flattened pool table
        self._row_start = torch.arange(s, dtype=torch.int32, device=dev) * (2 * width)
        self._row_start_ids = torch.arange(s, dtype=torch.int32, device=dev) * width
        self.host_request_types = torch.empty(s, dtype=torch.int32)
        self.host_total_kv_lens = torch.zeros(2, dtype=torch.int64)
        self._host_total_np = self.host_total_kv_lens.numpy()
        self._host_types_np = self.host_request_types.numpy()
        self.prompt_lens_cpu = torch.zeros(s, dtype=torch.int32)
        fields = {"seq_lens": s, "kv_lens": s, "qo_indptr": s + 1, "qo_indptr_gen": s + 1}
        fields["prompt_lens"] = s
        fields.update({f"slots{p}": t for p in range(self._num_pools)})
        # fp8 caches: the step's pages in row order, a load plan per pool (kvplan.backends.paged)
        self._load_pages = (
            self.kv_cache is not None and mgr is not None and self.kv_cache.is_quantized
        )
        if self._load_pages:
            check_int32("4 * max_num_sequences * max_blocks_per_seq", 4 * s * width)
            fields["page_start"] = s + 1
            fields.update({f"load{p}": 4 * s * width for p in range(self._num_pools)})
            fields["tok_loaded_start"] = t
            self._page_arange = torch.arange(s * width, dtype=torch.int32, device=dev)
        # cross attention only: last, so other steps stage (and copy) a shorter prefix
        fields.update({"tok_page_start": t, "tok_kv_lens": t})
        self.num_loaded_pages = 0
        self.arena = DeviceArena(fields, dev)
        self._seq_lens_gpu = self.arena.view("seq_lens")  # staged with the other fields
        self.prompt_lens_cuda = self.arena.view("prompt_lens")
        self._arange_tokens = torch.arange(t, dtype=torch.int32, device=dev)
        self.qo_indptr = self.arena.view("qo_indptr")
        if enable_block_id_tables:
            self.kv_block_ids_per_seq = torch.zeros((s, width), dtype=torch.int32, device=dev)
            self.block_ids_per_seq = torch.zeros((s, width), dtype=torch.int32, device=dev)
        self.block_id_tables_valid = False

    @property
    def kv_lens_cuda(self) -> torch.Tensor:
        """Keys attended per sequence (device int32 ``[num_seqs]``)."""
        return self.arena.view("kv_lens")[: self.num_seqs]

    def slot_mapping(self, pool: int = 0) -> torch.Tensor:
        return self.arena.view(f"slots{pool}")[: self.num_kv_tokens]

    # prepare ------------------------------------------------------------------------
    def _fill_step_fields(self) -> np.ndarray | None:
        """Host step fields; returns the validated ``prompt_lens`` (None when unset)."""
        n, nc = self._num_seqs, self._num_contexts
        valid = self.kv_lens_np  # cached + seq_lens_kv
        extra = self.num_extra_kv_tokens
        self.kv_lens = valid + np.int32(extra) if extra else valid
        # numpy views of the CPU tensors: element writes without per-call torch overhead
        total = self._host_total_np
        total[0] = SUM(valid[:nc]) if nc else 0
        total[1] = SUM(valid[nc:]) if n > nc else 0
        types = self._host_types_np
        types[:nc] = 0
        types[nc:n] = 1
        if self.prompt_lens is not None:
            prompt = as_int32_array("prompt_lens", self.prompt_lens)
            if prompt.size != n:
                raise ValueError(f"prompt_lens has {prompt.size} entries, expected {n}")
            self.prompt_lens_cpu.numpy()[:n] = prompt
            return prompt
        return None

    def _prepare_backend(self) -> None:
        n, nc = self._num_seqs, self._num_contexts
        prompt = self._fill_step_fields()
        valid = self.kv_lens_np
        cu_q = self.cu_seqlens_q_np
        values = {
            "kv_lens": valid,
            "qo_indptr": cu_q,
            "qo_indptr_gen": cu_q[nc:] - np.int32(self._num_ctx_tokens) if nc else cu_q,
        }
        if prompt is not None:  # prompt_lens_cuda is an arena view: staged with the rest
            values["prompt_lens"] = prompt
        mgr = self.kv_cache_manager
        if mgr is None:
            stage_without_cache(self, values)
            return
        bs = int(mgr.block_size)
        max_kv = int(MAX(self.kv_lens)) if n else 0
        if max_kv > mgr.max_seq_len:
            raise ValueError(
                f"kv_lens reach {max_kv}, past the manager's max_seq_len {mgr.max_seq_len}"
            )
        spec_active = self.is_spec_decoding_enabled or self.num_extra_kv_tokens > 0
        max_blocks = None if spec_active else -(-max_kv // bs)
        self.copied_width = mgr.max_blocks_per_seq if max_blocks is None else max(max_blocks, 1)
        mgr.copy_batch_block_offsets(
            self.kv_cache_block_offsets, self.request_ids, self.beam_width, nc, n,
            cross=self.is_cross, max_blocks=max_blocks,
        )  # fmt: skip
        # The persistent host buffer is for synchronous readers like this one.
        host = mgr.host_block_offsets(self.max_num_sequences, cross=self.is_cross).numpy()
        num_pages = logical_num_blocks(self.kv_lens, bs)
        last_blocks = check_allocated(host[0, :n, 0, :], num_pages,
                                      "kv_lens (incl. num_extra_kv_tokens)")  # fmt: skip
        decode = (
            last_blocks is not None and not self.num_extra_kv_tokens and self._num_pools == 1
            and self._num_kv_tokens == n and MIN(self._kv_np) == 1
        )  # fmt: skip
        for p in range(self._num_pools):
            if decode:  # the last held block is the new token's block
                slots = decode_token_slots(last_blocks, self.cached_np, bs)
            else:
                slots = new_token_slots(host[p, :n, 0, :], self.cached_np, self._kv_np, bs)
            values[f"slots{p}"] = slots
        if self.is_cross:
            q_rows = np.arange(n).repeat(self._seq_lens_np)
            values["tok_page_start"] = (q_rows * 2 * self.max_blocks_per_seq).astype(np.int32)
            values["tok_kv_lens"] = valid[q_rows]
        if self._load_pages:
            self._stage_page_loads(values, host[:, :n, 0, :], num_pages)
        self._stage_seq_lens(values)
        self.arena.stage(values)
        if self.enable_block_id_tables:
            self.prepare_block_id_tables()

    def _stage_page_loads(self, values: dict, tables: np.ndarray, num_pages: np.ndarray) -> None:
        """fp8: the pages each row may read (``ceil(kv_lens / block_size)``, draft tokens
        included), row by row, as a load plan per pool plus their row starts.

        ``tables``: host int32 ``[num_pools, num_seqs, max_blocks_per_seq]`` (this step's rows
        of the persistent buffer). The kernels then read the compact cache through
        ``page_ids = arange`` and ``page_start`` instead of the block-offset table.
        """
        bs = int(self.kv_cache_manager.block_size)
        start = exclusive_cumsum(num_pages)
        width = int(num_pages.max()) if num_pages.size else 0
        cols = np.arange(width, dtype=np.int32) < num_pages[:, None]
        for p in range(self._num_pools):
            values[f"load{p}"] = page_load_plan(tables[p, :, :width][cols], bs)
        values["page_start"] = start
        if self.is_cross:
            values["tok_loaded_start"] = start[
                np.repeat(np.arange(num_pages.size), self._seq_lens_np)
            ]
        self.num_loaded_pages = int(start[-1])

    def prepare_block_id_tables(self) -> None:
        """MLA-style ``kv_block_ids_per_seq`` (all rows) and ``block_ids_per_seq`` (generation
        rows first); pool 0. Skipped while a CUDA graph is capturing (request-specific fills
        must happen before replay, not be recorded into the graph)."""
        self.block_id_tables_valid = False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        n, nc = self.num_seqs, self.num_contexts
        need = logical_num_blocks(self.kv_lens, int(self.kv_cache_manager.block_size))
        width = int(need.max()) if n else 0
        table = batch_block_table(
            self.kv_cache_manager, self.request_ids, pool=0, beam_width=self.beam_width,
            num_contexts=nc, cross=self.is_cross, width=width,
        )  # fmt: skip
        snap = to_device(table, self.device)
        self.kv_block_ids_per_seq.fill_(0)
        self.kv_block_ids_per_seq[:n, :width].copy_(snap)
        self.block_ids_per_seq.fill_(0)
        self.block_ids_per_seq[: n - nc, :width].copy_(snap[nc:])
        self.block_id_tables_valid = True

    def prepare_encoder_only(self) -> None:
        """Encoder forward without a KV cache: lengths and request types only.

        ``host_request_types`` is never zero-initialized, so this path marks every row as a
        context row itself; otherwise a kernel could read stale values and treat a context
        segment as a generation step.
        """
        if self.kv_cache_manager is not None:
            raise ValueError("prepare_encoder_only() is for metadata without a kv_cache_manager")
        self.num_contexts = self.num_seqs
        self.prepare()
        self.host_request_types[: self.num_seqs].fill_(0)

    # kernel view --------------------------------------------------------------------
    def paged_view(self, pool: int, *, loaded_pages: bool = False) -> PagedView:
        """The kernels' view of pool ``pool``: the block-offset table (K entries; row b's pages
        start at ``b * 2 * max_blocks_per_seq``), or with ``loaded_pages`` the compact cache of
        ``load_batch_pages`` (ids ``arange``; row b's pages start at ``page_start[b]``)."""
        n, nc, ng = self.num_seqs, self.num_contexts, self.num_generations
        if loaded_pages:
            table = self._page_arange[: self.num_loaded_pages]
            row_start = self.arena.view("page_start")
            tok_start = self.arena.view("tok_loaded_start")
        else:
            table = self.kv_cache_block_offsets[pool].view(-1)
            row_start, tok_start = self._row_start, self.arena.view("tok_page_start")
        kv_lens = self.kv_lens_cuda
        q_lens = self._seq_lens_np
        max_kv = int(self.kv_lens_np.max()) if n else 0
        if self.is_cross:
            t = self.num_tokens
            seg = PagedSegment(
                table, tok_start[:t], self.arena.view("tok_kv_lens")[:t], None, t, 1, max_kv
            )
            return PagedView(seg, None, cross=True)
        ctx = gen = None
        if nc:
            ctx = PagedSegment(
                table, row_start[:nc], kv_lens[:nc], self.qo_indptr[: nc + 1],
                self.num_ctx_tokens, int(q_lens[:nc].max()), max_kv,
            )  # fmt: skip
        if ng:
            max_q = int(q_lens[nc:].max())
            cu = self.arena.view("qo_indptr_gen")[: ng + 1] if max_q > 1 else None
            if self.block_id_tables_valid and pool == 0 and not loaded_pages:
                # generation rows first: row g of block_ids_per_seq is generation sequence g
                ids, start = self.block_ids_per_seq.view(-1), self._row_start_ids[:ng]
            else:
                ids, start = table, row_start[nc:n]
            gen = PagedSegment(
                ids, start, kv_lens[nc:n], cu, self.num_tokens - self.num_ctx_tokens, max_q, max_kv
            )
        return PagedView(ctx, gen)


class BlockOffsetsAttention(AttentionBackend):
    """Paged kernels reading the block-offset table (see the module docstring)."""

    name = "block_offsets"
    Metadata = BlockOffsetsAttentionMetadata

    def _attend(self, q, k, v, metadata, pool, out):
        return attend_page_table(self, q, k, v, metadata, pool, out, metadata.num_loaded_pages)
