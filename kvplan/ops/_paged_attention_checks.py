"""Argument checks of ``kvplan.ops.paged_attention`` (shapes, dtypes, devices, quantized cache
layouts, and on request the values: page ranges, block ids, ``cu_seqlens_q``)."""

from __future__ import annotations

import math

import torch

from kvplan._checks import INT32_MAX, check_range, check_same_device, check_tensor
from kvplan.formats import KVCacheFormat
from kvplan.ops import _paged_attention_kernels as _k

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: torch.Tensor,
    page_start: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    kv_layout: KVCacheFormat | None,
    check_values: bool,
) -> tuple[int, int]:
    """Validate the arguments of ``paged_attention_{decode,prefill}`` (``cu_seqlens_q`` None
    for decode) and return ``(window, num_kv_heads)``, the window as an int (``NO_WINDOW`` =
    none). ``check_values`` adds the range checks that read the values (one device sync on
    CUDA). Raises ``TypeError`` / ``ValueError`` naming the argument."""
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if kv_layout is None:
        check_tensor("k_cache", k_cache, dtype=q.dtype, ndim=4)
        check_tensor("v_cache", v_cache, dtype=q.dtype, shape=tuple(k_cache.shape))
        num_kv_heads = k_cache.shape[2]
        if k_cache.shape[3] != head_dim:
            raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    else:
        num_kv_heads = _check_quantized_caches(k_cache, v_cache, head_dim, kv_layout)
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on head_dim, got strides {t.stride()}")
    check_tensor("page_ids", page_ids, dtype=torch.int32, ndim=1)
    check_tensor("kv_lens", kv_lens, dtype=torch.int32, ndim=1)
    batch = kv_lens.shape[0]
    check_tensor("page_start", page_start, dtype=torch.int32, shape=(batch,))
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, page_ids=page_ids)
    tensors.update(page_start=page_start, kv_lens=kv_lens)
    if cu_seqlens_q is not None:
        check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(batch + 1,))
        tensors["cu_seqlens_q"] = cu_seqlens_q
    elif q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows but kv_lens has {batch} sequences")
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError(f"out must have unit stride on head_dim, got strides {out.stride()}")
        tensors["out"] = out
    check_same_device(**tensors)
    if not (isinstance(scale, float | int) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if page_ids.numel() > INT32_MAX:
        raise ValueError(f"page_ids has {page_ids.numel()} entries, more than int32 can index")
    if check_values and batch > 0:
        _check_values(q, k_cache, page_ids, page_start, kv_lens, cu_seqlens_q)
    window = _k.NO_WINDOW if sliding_window is None else min(sliding_window, _k.NO_WINDOW)
    return window, num_kv_heads


def _check_quantized_caches(k_cache, v_cache, head_dim: int, kv_layout) -> int:
    """Checks of uint8 caches of a quantized ``kv_layout``; returns num_kv_heads."""
    if not isinstance(kv_layout, KVCacheFormat):
        raise TypeError(f"kv_layout must be a KVCacheFormat or None, got {kv_layout!r}")
    if not (kv_layout.is_quantized and kv_layout.do_cast and kv_layout.token_interleaved):
        raise ValueError(
            "kv_layout must be a quantized, cast-on-load, token-interleaved format, got "
            f"{kv_layout.note or kv_layout!r}"
        )
    group = kv_layout.elements_per_sf
    if head_dim % group or kv_layout.quantized_elements % head_dim:
        raise ValueError(
            f"kv_layout ({kv_layout.quantized_elements} values, {group} per scale) must hold "
            f"whole heads of whole scale groups; head_dim is {head_dim}"
        )
    shape = (None, None, 1, kv_layout.bytes_per_token)
    check_tensor("k_cache", k_cache, dtype=torch.uint8, ndim=4)
    check_tensor("k_cache", k_cache, shape=shape)
    check_tensor("v_cache", v_cache, dtype=torch.uint8, shape=tuple(k_cache.shape))
    if kv_layout.sf_format == "fp32":  # scales are read as fp32 words
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.data_ptr() % 4 or t.stride(0) % 4 or t.stride(1) % 4:
                raise ValueError(f"{name} records must be 4-byte aligned for fp32 scales")
    return kv_layout.quantized_elements // head_dim


def _check_values(q, k_cache, page_ids, page_start, kv_lens, cu_seqlens_q) -> None:
    """Range checks that need the values (one device sync on CUDA)."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    check_range("kv_lens", kv_lens, 0, 2**30)
    check_range("page_start", page_start, 0, max(page_ids.numel(), 1) + 1)
    pages = (kv_lens.long() + block_size - 1) // block_size
    end = page_start.long() + pages
    if int((end > page_ids.numel()).sum()):
        b = int(torch.nonzero(end > page_ids.numel())[0])
        raise ValueError(
            f"sequence {b} needs page_ids[{int(page_start[b])}:{int(end[b])}] but page_ids has "
            f"{page_ids.numel()} entries"
        )
    # Only the entries some sequence reads must be block ids (a preallocated ragged buffer may
    # hold anything past its used prefix): mark them with a difference array, O(n + B).
    marks = torch.zeros(page_ids.numel() + 1, dtype=torch.int32, device=page_ids.device)
    marks.index_add_(0, page_start.long(), torch.ones_like(page_start))
    marks.index_add_(0, end, -torch.ones_like(page_start))
    used = marks.cumsum(0)[:-1] > 0
    check_range("page_ids (entries in use)", page_ids[used], 0, num_blocks)
    if cu_seqlens_q is not None:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != q.shape[0]:
            raise ValueError(
                f"cu_seqlens_q must run from 0 to {q.shape[0]} (q rows), got "
                f"{int(cu_seqlens_q[0])} .. {int(cu_seqlens_q[-1])}"
            )
        check_range("cu_seqlens_q differences", q_lens, 0, 2**31 - 1)
        if int((q_lens > kv_lens).sum()):
            b = int(torch.nonzero(q_lens > kv_lens)[0])
            raise ValueError(
                f"sequence {b} has {int(q_lens[b])} queries but kv_lens[{b}] = {int(kv_lens[b])}"
                " (the new tokens' KV must already be in the cache)"
            )
