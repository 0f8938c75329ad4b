"""Block-offsets backend (TensorRT-LLM-style): a fixed-width 4-D block table per step.

``prepare()`` fills ``kv_cache_block_offsets`` int32 ``[num_pools, max_num_sequences, 2,
max_blocks_per_seq]`` (dim 2: 0 = K, 1 = V; both hold the block id, since K and V are separate
tensors indexed by the same id). The table is a field of the metadata's ``DeviceArena``: the
rows are gathered from the manager's tables (``KVCacheManager.batch_tables``) straight into
the step's private pinned snapshot, which then goes to the device in the SAME single async
copy as every other field (lengths, indptrs, slots). Rows: context requests one each (beam 0),
then generation requests ``beam_width`` each (cross attention repeats the request's encoder
row). Rows ``[0, num_seqs)`` are written whole (block 0 past each row's allocated blocks);
rows past them hold unspecified values (a CUDA-graph runner zeroes its padding rows itself).
The kernels read that table directly: pool p's pages of row b are
``table[p].flatten()[b * 2 * max_blocks_per_seq + j]`` (the K entries, used for both the K
and the V cache; the V entries are equal by construction and kept for the layout).

Lengths (addressable vs valid):
    kv_lens       host int32 ``[num_seqs]`` = cached + seq_lens_kv + num_extra_kv_tokens: the
                  addressable bound (draft tokens a speculative sub-step may append on the
                  device); every row must own its blocks, and it is checked against ``max_seq_len``.
    kv_lens_cuda  device int32 = cached + seq_lens_kv: the keys attention reads.
    host_total_kv_lens  ``[2]``: sum of kv_lens_cuda over context rows, generation rows.
    host_request_types  ``[max_num_sequences]`` int32 (0 = context, 1 = generation); allocated
                  uninitialized (``torch.empty``), filled by ``prepare()`` and also by
                  ``prepare_encoder_only()``.

Width: every column of a batch row is copied (``copied_width == max_blocks_per_seq``), so a
device-side speculative sub-step that dereferences reserved columns never reads stale ids;
whole rows also keep the table one contiguous run of the arena (one copy, no strided one).

``enable_block_id_tables`` adds the MLA-style decode tables: ``kv_block_ids_per_seq``
``[max_num_sequences, max_blocks_per_seq]`` (all rows) and ``block_ids_per_seq`` (generation
rows first, so row g is generation sequence g), zero-filled then copied, skipped while a CUDA
graph is capturing; the generation segment's decode then reads ``block_ids_per_seq``.

Quantized caches (fp8, fp4) need nothing more here: the kernels read their pages in place
through the same table (``kvplan.backends.page_table_attention``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan.backends.block_tables import (
    PerBatch,
    gather_rows,
    logical_num_blocks,
)
from kvplan.backends.fresh_prefill import first_fresh_row
from kvplan.backends.lengths import SUM, as_int32_array
from kvplan.backends.page_table_attention import PagedSegment, PagedView, PageTableAttention
from kvplan.backends.paged_metadata import PagedMetadata
from kvplan.backends.staging import DeviceArena, DeviceExpander, to_device


class BlockOffsetsAttentionMetadata(PagedMetadata):
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
        width = 1 if mgr is None else int(mgr.max_blocks_per_seq)
        self.max_blocks_per_seq = width
        check_int32("num_pools * max_num_sequences * 2 * max_blocks_per_seq",
                    self._num_pools * s * 2 * width)  # fmt: skip
        dev = self.device
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
        fields["cached"] = s  # the device expands a general step's slots from it
        fields.update({f"slots{p}": t for p in range(self._num_pools)})
        fields["block_offsets"] = self._num_pools * s * 2 * width
        # cross attention only: last, so other steps stage (and copy) a shorter prefix
        fields.update({"tok_page_start": t, "tok_kv_lens": t})
        self.arena = DeviceArena(fields, dev)
        self._offsets = self.arena.offsets
        self._seq_lens_gpu = self.arena.view("seq_lens")  # staged with the other fields
        # the block-offset table is an arena field too: one staged copy per step sends it all
        self.kv_cache_block_offsets = self.arena.view("block_offsets").view(
            self._num_pools, s, 2, width
        )
        self.copied_width = width
        self._rows_twice = PerBatch(lambda rows: rows.repeat(2))  # K and V rows of a row
        self.prompt_lens_cuda = self.arena.view("prompt_lens")
        # 0, 1, ...: the page ids of a context-only batch without a cache (device int32 [t])
        self.token_arange = torch.arange(t, dtype=torch.int32, device=dev)
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
        return self.arena.prefix(f"slots{pool}", self._num_kv_tokens)

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
        total[1] = self.num_cached_tokens + self._num_kv_tokens - int(total[0])
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
        mgr = self.kv_cache_manager
        if mgr is None:
            values = {"kv_lens": valid, "qo_indptr": cu_q}
            values["qo_indptr_gen"] = cu_q[nc:] - np.int32(self._num_ctx_tokens) if nc else cu_q
            if prompt is not None:  # prompt_lens_cuda is an arena view: staged with the rest
                values["prompt_lens"] = prompt
            self._stage_context_only(values)
            return
        bs, width, num_pools = self._block_size, self.max_blocks_per_seq, self._num_pools
        extra = self.num_extra_kv_tokens
        max_kv = self.max_kv_len + extra if n else 0  # addressable
        if max_kv > mgr.max_seq_len:
            raise ValueError(
                f"kv_lens reach {max_kv}, past the manager's max_seq_len {mgr.max_seq_len}"
            )
        # validate everything before staging starts (a CPU arena is written in place); a
        # decode step's new token is each row's last addressable one (no draft tokens)
        decode = self.one_kv_token_per_row and not extra and self.decode_fast_path
        on_device = self._expands_tokens(decode)
        step = self._step_rows(decode=decode, extra_tokens=extra, per_token=not on_device)
        bt = step.tables
        arena = self.arena
        row_span, pool_span = 2 * width, self.max_num_sequences * 2 * width
        cross = self._seq_lens_kv is not None  # is_cross, without the property call
        if cross:
            end = arena.end_of("tok_kv_lens", self._num_tokens)
        else:
            end = self._offsets["block_offsets"] + (num_pools - 1) * pool_span + n * row_span
        # Fields are written at their arena offsets (``o``) straight into the staging
        # buffer; every size is within its capacity: n <= max_num_sequences (seq_lens
        # setter), T <= max_num_tokens (_prepare_common).
        o, T = self._offsets, self._num_kv_tokens
        host = arena.begin(end)
        self._put_seq_lens(host, o["seq_lens"])
        host[o["kv_lens"] : o["kv_lens"] + n] = valid
        host[o["qo_indptr"] : o["qo_indptr"] + n + 1] = cu_q
        a = o["qo_indptr_gen"]
        if nc:
            np.subtract(cu_q[nc:], np.int32(self._num_ctx_tokens), out=host[a : a + n - nc + 1])
        else:
            host[a : a + n + 1] = cu_q
        if prompt is not None:  # prompt_lens_cuda is an arena view: staged with the rest
            arena.put(host, "prompt_lens", prompt)
        if on_device:
            host[o["cached"] : o["cached"] + n] = self.cached_np
        rows_twice = self._rows_twice(bt.rows)
        for p in range(num_pools):
            if not on_device:
                step.write_slots(p, bs, host[o[f"slots{p}"] : o[f"slots{p}"] + T])
            # rows [0, n) of pool p: K and V entries both name the block (rows_twice)
            start = o["block_offsets"] + p * pool_span
            gather_rows(bt, p, host[start : start + n * row_span].reshape(2 * n, width), rows_twice)
            if p < num_pools - 1:  # inside the copied prefix: rows past the batch read 0
                host[start + n * row_span : start + pool_span] = 0
        if cross:
            q_rows = self._arange[:n].repeat(self._seq_lens_np)
            arena.put(host, "tok_page_start", q_rows * np.int32(row_span))
            arena.put(host, "tok_kv_lens", valid[q_rows])
        arena.commit()
        if on_device:
            self._expand_on_device()
        if self.enable_block_id_tables:
            self.prepare_block_id_tables()

    def _bind_expansion(self, expander: DeviceExpander, key: None) -> tuple:
        """A general step's slots from ``qo_indptr`` / ``cached`` and the table's K entries
        (row b of pool p at ``block_offsets + p * pool_span + b * 2 * width``)."""
        o, row_span = self._offsets, 2 * self.max_blocks_per_seq
        return expander.bind(
            tokens=True, pages=False, cu_off=o["qo_indptr"], cached_off=o["cached"],
            table_off=o["block_offsets"], table_pool_stride=self.max_num_sequences * row_span,
            row_stride=row_span, slots_off=o["slots0"], slots_pool_stride=self.max_num_tokens,
            block_size=self._block_size,
        )  # fmt: skip

    def prepare_block_id_tables(self) -> None:
        """MLA-style ``kv_block_ids_per_seq`` (all rows) and ``block_ids_per_seq`` (generation
        rows first); pool 0. Skipped while a CUDA graph is capturing (request-specific fills
        must happen before replay, not be recorded into the graph)."""
        self.block_id_tables_valid = False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        n, nc = self.num_seqs, self.num_contexts
        need = logical_num_blocks(self.kv_lens, self._block_size)
        width = int(need.max()) if n else 0
        bt = self.kv_cache_manager.batch_tables(
            self.request_ids, self.beam_width, nc, cross=self.is_cross
        )
        snap = to_device(gather_rows(bt, 0)[:, :width], self.device)
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
    def paged_view(self, pool: int) -> PagedView:
        """The kernels' view of pool ``pool``: the block-offset table (K entries; row b's pages
        start at ``b * 2 * max_blocks_per_seq``)."""
        n, nc, ng = self.num_seqs, self.num_contexts, self.num_generations
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
                self.cu_seqlens_q_np[: nc + 1], first_fresh_row(self.cached_np[:nc]),
            )  # fmt: skip
        if ng:
            max_q = int(q_lens[nc:].max())
            cu = self.arena.view("qo_indptr_gen")[: ng + 1] if max_q > 1 else None
            if self.block_id_tables_valid and pool == 0:
                # generation rows first: row g of block_ids_per_seq is generation sequence g
                ids, start = self.block_ids_per_seq.view(-1), self._row_start_ids[:ng]
            else:
                ids, start = table, row_start[nc:n]
            gen = PagedSegment(
                ids, start, kv_lens[nc:n], cu, self.num_tokens - self.num_ctx_tokens, max_q, max_kv
            )
        return PagedView(ctx, gen)


class BlockOffsetsAttention(PageTableAttention):
    """Paged kernels reading the block-offset table (see the module docstring)."""

    name = "block_offsets"
    Metadata = BlockOffsetsAttentionMetadata
