"""Run the paged-attention kernels over one backend's page table (ragged or block offsets).

Both paged backends reduce their own format to a ``PagedView``: a flat ``page_ids`` tensor plus
``page_start`` offsets (``kvplan.ops.paged_attention``'s page-table contract), separately for
the context segment (varlen prefill kernel) and the generation segment (split-K decode kernel
when every generation row has one query, else the varlen kernel, e.g. speculative rows).
Cross attention (no causal mask) runs the decode kernel with one "sequence" per query token:
each token's query attends all ``kv_lens`` keys of its row.

Every host value here (segment sizes, maxima) comes from ``prepare()``; nothing syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvplan.backends.staging import to_device
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
    """Fill ``out`` ``[T, H, D]`` from ``q`` ``[T, H, D]`` over a ``PagedView``.

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


def layer_caches(kv_cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of ``layer`` in a dtype the kernels read.

    Plain caches are returned as they are. fp8 caches are dequantized whole to bf16
    (``KVCacheTensors.read_blocks`` over every block; one device sync): the paged kernels do
    not read quantized pages, so this is a correctness path, not a fast one.
    """
    if not kv_cache.is_quantized:
        return kv_cache.k_cache(layer), kv_cache.v_cache(layer)
    every = torch.arange(kv_cache.num_blocks, device=kv_cache.device)
    return kv_cache.read_blocks(layer, every)


def attend_without_cache(backend, q, k, v, md, out) -> torch.Tensor:
    """Context-only batch without a KV cache: the new K/V rows are the pages (block size 1).

    ``k`` ``[T_kv, Hkv, D]`` viewed as ``[T_kv, 1, Hkv, D]`` is a cache of one-token pages with
    page ids ``arange(T_kv)``; sequence b's pages start at its first K/V row. Self attention
    runs the varlen kernel (``qo_indptr`` gives both the query rows and the page starts);
    cross attention runs one decode row per query token over its sequence's K/V rows.
    """
    n = md.num_seqs
    max_kv = int(md.kv_lens_np.max()) if n else 0
    if md.is_cross:
        q_rows = np.repeat(np.arange(n), md._seq_lens_np)
        ids = torch.arange(md.num_kv_tokens, dtype=torch.int32, device=q.device)
        start = to_device(md.cu_seqlens_kv_np[q_rows], q.device)
        lens = to_device(md.kv_lens_np[q_rows], q.device)
        view = PagedView(PagedSegment(ids, start, lens, None, md.num_tokens, 1, max_kv), None, True)
    else:
        max_q = int(md._seq_lens_np.max()) if n else 0
        seg = PagedSegment(
            md._arange_tokens, md.qo_indptr[:n], md.seq_lens_gpu, md.qo_indptr[: n + 1],
            md.num_tokens, max_q, max_kv,
        )  # fmt: skip
        view = PagedView(seg, None)
    return attend_paged(
        q, k.unsqueeze(1), v.unsqueeze(1), view, out,
        scale=backend.scale, window=backend.window(md), check=md.check_kernel_inputs,
    )  # fmt: skip
