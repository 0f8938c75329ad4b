"""The forward side of the page-table backends (ragged, block offsets): run the paged kernels.

``PageTableAttention._attend`` (one layer, after ``AttentionBackend.forward`` stored the
step's K/V) picks the K/V caches and asks the metadata for its ``PagedView`` of the layer's
pool, then ``attend_paged`` launches ``kvplan.ops.paged_attention`` over it. A ``PagedView``
is each backend's format reduced to the kernels' page-table contract: a flat ``page_ids``
tensor plus ``page_start`` offsets, separately for the context segment (varlen prefill
kernel) and the generation segment (split-K decode kernel when every generation row has one
query, else the varlen kernel, e.g. speculative rows). Cross attention (no causal mask) runs
the decode kernel with one "sequence" per query token over all ``kv_lens`` keys of its row.

Every host value here (segment sizes, maxima) comes from ``prepare()``; nothing syncs.

Quantized caches (fp8, fp4, int8): the kernels read the pages in place -- each K/V tile's e4m3 /
e2m1 values and their group scales are loaded from the cache's records and dequantized in
registers to bf16 (``kv_layout`` of ``kvplan.ops.paged_attention``) -- so a forward
allocates nothing per step and is CUDA-graph capturable like a bf16 one. On the CPU the torch
path dequantizes the gathered keys (``kvplan.quant.dequantize``), the same bf16 values. A
prefill's fresh rows (no cached history) run SDPA or flash over the values their cache rows
hold, read back and dequantized once (``KVCacheTensors.read_slots``): the same attention as the
paged kernel's, at the fused kernels' speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvplan.backends.base import AttentionBackend
from kvplan.backends.fresh_prefill import prefill_fresh_rows
from kvplan.backends.staging import to_device
from kvplan.formats import KVCacheFormat
from kvplan.ops.paged_attention import paged_attention_decode, paged_attention_prefill


@dataclass
class PagedSegment:
    """One kernel launch's page table: rows' pages are ``page_ids[page_start[b] + j]``."""

    page_ids: torch.Tensor  # int32 flat, device
    page_start: torch.Tensor  # int32 [rows], device
    kv_lens: torch.Tensor  # int32 [rows], device: keys attended per row
    # int32 [rows + 1] relative to the segment's first token; None = one query per row (decode)
    cu_seqlens_q: torch.Tensor | None
    num_tokens: int  # query tokens of the segment (host)
    max_q_len: int  # host bound on each row's queries
    max_kv_len: int  # host bound on kv_lens
    # context segments: host cu_seqlens_q [rows + 1] (0-based) and the first row of the
    # trailing run of rows with no cached tokens (kvplan.backends.fresh_prefill); None = unknown
    host_cu_seqlens_q: np.ndarray | None = None
    fresh_from: int | None = None


@dataclass
class PagedView:
    """The context and generation segments of one step (either may be ``None``)."""

    context: PagedSegment | None
    generation: PagedSegment | None
    cross: bool = False


class PageTableAttention(AttentionBackend):
    """``_attend`` of the page-table backends; their metadata provides ``paged_view(pool)
    -> PagedView`` and ``check_kernel_inputs``."""

    def _attend(self, q, k, v, metadata, pool, out):
        md = metadata
        kv_layout = None
        if md.kv_cache_manager is None:  # the new K/V rows are the pages (block size 1)
            k_cache, v_cache, view = k.unsqueeze(1), v.unsqueeze(1), context_only_view(md, q.device)
        else:
            k_cache, v_cache, kv_layout = layer_caches(md.kv_cache, self.layer_idx)
            view = md.kernel_view(pool)
        stored_rows = None
        if kv_layout is not None:  # the context rows as stored (the context segment is first)

            def stored_rows(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
                return md.kv_cache.read_slots(self.layer_idx, md.slot_mapping(pool)[lo:hi])

        recent = md.recent if md.kv_cache_manager is not None and not view.cross else None
        return attend_paged(
            q, k_cache, v_cache, view, out, scale=self.scale, window=self.window(md),
            check=md.check_kernel_inputs, kv_layout=kv_layout, k_new=k, v_new=v,
            stored_rows=stored_rows, recent=recent, layer=self.layer_idx,
        )  # fmt: skip


def attend_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    view: PagedView,
    out: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    check: bool = False,
    kv_layout: KVCacheFormat | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    stored_rows=None,
    recent=None,
    layer: int = 0,
) -> torch.Tensor:
    """Fill ``out`` ``[T, H, D]`` from ``q`` ``[T, H, D]`` over a ``PagedView`` of the caches
    ``[num_pages, page_size, Hkv, D]``, or of uint8 ``[num_pages, page_size, 1,
    bytes_per_token]`` caches of the quantized format ``kv_layout``.

    ``q`` is cast to the cache dtype (bf16 for a quantized cache) when they differ, and the
    result is written back in ``out``'s dtype. ``check`` lets the kernels validate their
    inputs (a device sync; for tests).

    ``k_new`` / ``v_new``: the step's new K/V rows ``[T, Hkv, D]`` (self attention: row t is
    query row t's token). A context segment whose trailing rows have no cached history runs
    those rows with SDPA or flash attention on these rows instead of the paged kernel when
    ``kvplan.backends.fresh_prefill`` allows (unquantized cache of k's dtype; the switches
    ``KVPLAN_PREFILL_SDPA`` and ``KVPLAN_PREFILL_FLASH``); None keeps every segment on the
    paged kernels. ``stored_rows`` (quantized caches): ``(lo, hi) -> (k, v)``, the BF16 values
    the cache holds for the context segment's rows ``lo .. hi - 1``; with it the fresh rows of
    a quantized cache run SDPA or flash over those values (the paged kernel's attention),
    without it they stay on the paged kernel (``kvplan.backends.fresh_prefill``).

    ``recent``: the step's `kvplan.cache.recent_window.RecentStep` (its sequences in the
    segments' row order) or None; with it every segment reads ``layer``'s recent-window ring
    (the fresh rows of a quantized cache: SDPA or flash over their exact values where no
    fresh prompt is longer than the window, `prefill_fresh_rows`).
    """
    cache_dtype = k_cache.dtype if kv_layout is None else torch.bfloat16
    start = row = 0
    for seg in (view.context, view.generation):
        if seg is None:
            continue
        first, rows = row, seg.kv_lens.shape[0]  # the segment's sequences in the step's order
        row += rows
        if seg.num_tokens == 0:
            continue
        ring = None if recent is None else recent.ring(layer, first, row)
        end = start + seg.num_tokens
        q_seg = q[start:end]
        direct = q_seg.dtype == cache_dtype
        if not direct:
            q_seg = q_seg.to(cache_dtype)
        dst = out[start:end] if direct and out.dtype == cache_dtype else None
        if view.cross or seg.cu_seqlens_q is None:
            res = paged_attention_decode(
                q_seg, k_cache, v_cache, seg.page_ids, seg.page_start, seg.kv_lens,
                scale=scale, sliding_window=None if view.cross else window, out=dst,
                max_kv_len=seg.max_kv_len, kv_layout=kv_layout, check=check, ring=ring,
            )  # fmt: skip
        else:
            res = None
            if seg is view.context and k_new is not None and v_new is not None:
                res = prefill_fresh_rows(
                    q_seg, k_new[start:end], v_new[start:end], k_cache, v_cache, seg,
                    scale=scale, window=window, out=dst, kv_layout=kv_layout, check=check,
                    stored_rows=stored_rows, ring=ring,
                )  # fmt: skip
            if res is None:
                res = paged_attention_prefill(
                    q_seg, k_cache, v_cache, seg.page_ids, seg.page_start, seg.cu_seqlens_q,
                    seg.kv_lens, scale=scale, sliding_window=window, out=dst,
                    max_q_len=seg.max_q_len, kv_layout=kv_layout, check=check, ring=ring,
                )  # fmt: skip
        if dst is None:
            out[start:end] = res.to(out.dtype)
        start = end
    return out


def context_only_view(md, device: torch.device) -> PagedView:
    """The view of a context-only batch without a KV cache: the new K/V rows ``[T_kv, Hkv,
    D]``, viewed as ``[T_kv, 1, Hkv, D]``, are a cache of one-token pages with page ids
    ``arange(T_kv)``; sequence b's pages start at its first K/V row. Self attention runs the
    varlen kernel (``qo_indptr`` gives both the query rows and the page starts); cross
    attention one decode row per query token over its sequence's K/V rows."""
    n = md.num_seqs
    max_kv = int(md.kv_lens_np.max()) if n else 0
    seq_lens = md.seq_lens_np
    if md.is_cross:
        q_rows = np.repeat(np.arange(n), seq_lens)
        ids = torch.arange(md.num_kv_tokens, dtype=torch.int32, device=device)
        start = to_device(md.cu_seqlens_kv_np[q_rows], device)
        lens = to_device(md.kv_lens_np[q_rows], device)
        return PagedView(PagedSegment(ids, start, lens, None, md.num_tokens, 1, max_kv), None, True)
    max_q = int(seq_lens.max()) if n else 0
    seg = PagedSegment(
        md.token_arange, md.qo_indptr[:n], md.seq_lens_gpu, md.qo_indptr[: n + 1],
        md.num_tokens, max_q, max_kv, md.cu_seqlens_q_np[: n + 1], 0,
    )  # fmt: skip
    return PagedView(seg, None)


def layer_caches(kv_cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, KVCacheFormat | None]:
    """K and V caches of ``layer`` as the kernels read them, with their ``kv_layout``.

    Plain caches: the typed ``[N, bs, Hkv, D]`` views and None. Quantized caches: the raw
    uint8 ``[N, bs, 1, bytes_per_token]`` caches and their ``KVCacheFormat`` (read in place).
    """
    if not kv_cache.is_quantized:
        return kv_cache.k_cache(layer), kv_cache.v_cache(layer), None
    return kv_cache.raw_k_cache(layer), kv_cache.raw_v_cache(layer), kv_cache.layout
