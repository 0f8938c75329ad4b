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

fp8 caches: the kernels read bf16 pages, so ``prepare()`` also builds a load plan of exactly
the pages the step reads (``block_tables.page_load_plan``, staged with the other fields) and
each layer's forward dequantizes those pages into a compact bf16 cache (``load_batch_pages``:
one ``kvplan.load_paged_kv_cache`` per K and V, no device sync) whose page table is
``arange``. The compact cache is allocated per layer call, so fp8 forwards are not CUDA-graph
capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvplan.backends.base import AttentionBackend
from kvplan.backends.staging import to_device
from kvplan.ops.load import load_paged_kv_cache
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


@dataclass
class PagedView:
    """The context and generation segments of one step (either may be ``None``)."""

    context: PagedSegment | None
    generation: PagedSegment | None
    cross: bool = False


class PageTableAttention(AttentionBackend):
    """``_attend`` of the page-table backends; their metadata provides ``paged_view(pool,
    *, loaded_pages=False) -> PagedView``, ``loads_pages``, ``num_loaded_pages``,
    ``check_kernel_inputs`` and the arena fields ``load{pool}`` (fp8 load plans)."""

    def _attend(self, q, k, v, metadata, pool, out):
        md = metadata
        if md.kv_cache_manager is None:  # the new K/V rows are the pages (block size 1)
            k_cache, v_cache, view = k.unsqueeze(1), v.unsqueeze(1), context_only_view(md, q.device)
        elif md.kv_cache.is_quantized and md.loads_pages:  # only the step's pages, in order
            k_cache, v_cache = load_batch_pages(
                md.kv_cache, self.layer_idx, md.arena.view(f"load{pool}"), md.num_loaded_pages
            )
            view = md.paged_view(pool, loaded_pages=True)
        else:
            k_cache, v_cache = layer_caches(md.kv_cache, self.layer_idx)
            view = md.paged_view(pool)
        return attend_paged(
            q, k_cache, v_cache, view, out, scale=self.scale, window=self.window(md),
            check=md.check_kernel_inputs,
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
) -> torch.Tensor:
    """Fill ``out`` ``[T, H, D]`` from ``q`` ``[T, H, D]`` over a ``PagedView`` of the caches
    ``[num_pages, page_size, Hkv, D]``.

    ``q`` is cast to the cache dtype when they differ (the kernels read one dtype), and the
    result is written back in ``out``'s dtype. ``check`` lets the kernels validate their
    inputs (a device sync; for tests).
    """
    cache_dtype = k_cache.dtype
    start = 0
    for seg in (view.context, view.generation):
        if seg is None or seg.num_tokens == 0:
            continue
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
                max_kv_len=seg.max_kv_len, check=check,
            )  # fmt: skip
        else:
            res = paged_attention_prefill(
                q_seg, k_cache, v_cache, seg.page_ids, seg.page_start, seg.cu_seqlens_q,
                seg.kv_lens, scale=scale, sliding_window=window, out=dst,
                max_q_len=seg.max_q_len, check=check,
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
        md.num_tokens, max_q, max_kv,
    )  # fmt: skip
    return PagedView(seg, None)


def layer_caches(kv_cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of ``layer`` in a dtype the kernels read.

    Plain caches are returned as they are. fp8 caches are dequantized whole to bf16
    (``KVCacheTensors.read_blocks`` over every block; one device sync). The paged backends
    only take this path for an fp8 cache they were not built with (``kv_cache`` assigned
    after construction); normally they load just the batch's pages (``load_batch_pages``).
    """
    if not kv_cache.is_quantized:
        return kv_cache.k_cache(layer), kv_cache.v_cache(layer)
    every = torch.arange(kv_cache.num_blocks_of(layer), device=kv_cache.device)
    return kv_cache.read_blocks(layer, every)


def load_batch_pages(
    kv_cache, layer: int, plan: torch.Tensor, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize only the pages a batch reads: bf16 K and V ``[num_pages, bs, H, D]``.

    ``plan``: device int32 holding at least ``num_pages * 4`` entries of ``page_load_plan``
    (built on the host by ``prepare()``). Runs ``kvplan.load_paged_kv_cache`` (Triton on
    CUDA) without its plan check, so nothing syncs: the plan's block ids come from the
    manager's table and were validated on the host. Every page is loaded whole (rows past
    a sequence's length are finite cache bytes the kernels mask out). Call it after this
    step's K/V were stored.
    """
    bs, h, d = kv_cache.block_size, kv_cache.num_kv_heads, kv_cache.head_dim
    segments = plan[: num_pages * 4].view(num_pages, 4)  # [m, 4]
    out = []
    for raw in (kv_cache.raw_k_cache(layer), kv_cache.raw_v_cache(layer)):
        rows = load_paged_kv_cache(
            raw, segments, num_pages * bs, layout=kv_cache.layout, check=False
        )
        out.append(rows.view(num_pages, bs, h, d))  # [m*bs, H*D] -> [m, bs, H, D]
    return out[0], out[1]
