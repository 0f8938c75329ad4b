"""Context segments whose trailing rows have no cached history: SDPA or flash on those rows.

A context row with no cached tokens (``num_cached_tokens_per_seq[b] == 0``, so ``kv_len ==
q_len``) attends only over the K/V rows this step computed for it, so the fresh rows can be
read straight from the step's ``k`` / ``v``; the rows before them (continuing chunks,
prefix-cache hits) still go through the paged Triton kernel. The scheduler orders running
requests (continuing chunks) before newly admitted ones, so the split is a prefix / suffix of
the segment's rows::

    rows      0        1        2      3          cached = [96, 0, 0, 0]
    cached    96       0        0      0          first_fresh_row -> 1
              |paged | SDPA or flash over rows 1..3 (rebased to row 1's first token)|

The fresh rows take the first path that applies, in this order:

1. ``kvplan.ops.sdpa_prefill``: torch SDPA, one call per run of equal-length sequences
   (``KVPLAN_PREFILL_SDPA``; on by default for CUDA tensors);
2. ``kvplan.ops.flash_prefill``: torch's varlen flash kernel, one call
   (``KVPLAN_PREFILL_FLASH``; CUDA only);
3. neither: the caller runs the paged kernel over the whole segment, as before.

Every decision uses host facts the planner already has (``cached_np``, ``cu_seqlens_q_np``)
and tensor metadata (dtype, shape, device); nothing syncs. ``kvplan.ops.flash_prefill`` lists
what each path supports.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kvplan.formats import KVCacheFormat
from kvplan.ops.flash_prefill import flash_prefill, flash_prefill_unsupported
from kvplan.ops.paged_attention import RecentRing, paged_attention_prefill
from kvplan.ops.sdpa_prefill import equal_length_groups, sdpa_prefill, sdpa_prefill_unsupported


def first_fresh_row(cached: np.ndarray) -> int:
    """Index of the first row of the trailing run of rows with no cached tokens.

    ``cached``: int ``[rows]`` host array (cached tokens per row). Returns ``rows`` when the
    last row has history (no fresh suffix).

    >>> first_fresh_row(np.array([96, 0, 0, 0])), first_fresh_row(np.array([0, 5, 0]))
    (1, 2)
    >>> first_fresh_row(np.array([0, 0])), first_fresh_row(np.array([3]))
    (0, 1)
    """
    nz = np.flatnonzero(cached)
    return int(nz[-1]) + 1 if nz.size else 0


class FreshSplit(NamedTuple):
    """Rows ``[0, num_paged_rows)`` (tokens ``[0, num_paged_tokens)``) run the paged kernel;
    the rest run SDPA or flash. Maxima are host bounds of each part's query run lengths."""

    num_paged_rows: int
    num_paged_tokens: int
    paged_max_q_len: int
    flash_max_q_len: int


STORED_ROWS_MIN_LEN = 1024
"""Quantized caches: the longest fresh prompt from which the fresh rows take SDPA / flash over
their stored values (``stored_rows``). Reading the rows back costs a launch per cache and
layer (``kvplan.ops.read_slots`` on CUDA); with short prompts the attention it speeds up is
small (64 prompts of 256 tokens of a 1B Llama: ~0.5 ms of prefill attention in all), with long
ones it dominates the step (H200, one 8,192-token prompt of that Llama, 2026-12-02: fp8 54.6
vs 63.4 ms with the paged kernel, when the read-back was still the torch dequantization)."""


def fresh_split(cu_seqlens_q: np.ndarray, fresh_from: int) -> FreshSplit | None:
    """Where a segment splits, from its host ``cu_seqlens_q`` ``[rows + 1]`` (0-based) and
    its first fresh row; None when no row is fresh.

    >>> fresh_split(np.array([0, 32, 4128, 8224]), 1)
    FreshSplit(num_paged_rows=1, num_paged_tokens=32, paged_max_q_len=32, flash_max_q_len=4096)
    """
    rows = cu_seqlens_q.size - 1
    if fresh_from >= rows:
        return None
    lens = np.diff(cu_seqlens_q)
    paged_max = int(lens[:fresh_from].max()) if fresh_from else 0
    return FreshSplit(
        fresh_from, int(cu_seqlens_q[fresh_from]), paged_max, int(lens[fresh_from:].max())
    )


def prefill_fresh_rows(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg,
    *,
    scale: float,
    window: int | None,
    out: torch.Tensor | None,
    kv_layout: KVCacheFormat | None,
    check: bool,
    stored_rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ring: RecentRing | None = None,
) -> torch.Tensor | None:
    """One context segment with SDPA or flash on its fresh rows; None when neither applies.

    Args:
        q: ``[T, H, D]`` the segment's queries (already in the cache dtype).
        k_new, v_new: ``[T, Hkv, D]`` the same rows' new K/V (stored in the cache already).
        k_cache, v_cache, kv_layout, check: as in ``paged_attention_prefill``.
        seg: the segment's ``PagedSegment`` (``fresh_from`` and ``host_cu_seqlens_q`` set).
        out: optional ``[T, H, D]`` destination in q's dtype.
        stored_rows: quantized caches: ``(lo, hi) -> (k, v)``, the BF16 ``[hi - lo, Hkv, D]``
            values the cache holds for the segment's rows ``lo .. hi - 1`` (dequantized, the
            values the paged kernel reads); the fresh rows then attend over those with SDPA
            or flash, the same attention as the paged kernel's, when the longest fresh prompt
            has at least ``STORED_ROWS_MIN_LEN`` tokens. None: a quantized cache keeps the
            paged kernel.
        ring: the segment's recent-window ring (`kvplan.ops.paged_attention.RecentRing`,
            kv_exact_window): the paged rows read it. Where no fresh prompt is longer than
            ``ring.window`` each fresh query reads every key exact: SDPA or flash over the
            new rows in bf16 (what the ring holds; no stored rows read back). A longer one
            needs each query's own bound (keys more than ``window`` back read quantized):
            the paged kernel over the stored rows as bf16 pages with the new rows as the
            ring (`_windowed_fresh_rows`; ``KVPLAN_WINDOW_FRESH=0`` or shorter prompts: None,
            the paged kernel over the quantized pages).

    Returns ``out`` (or a new tensor) with every row written, or None (then the caller runs
    the paged kernel over the whole segment; ``out`` may hold partial results meanwhile).
    """
    if seg.fresh_from is None or seg.host_cu_seqlens_q is None:
        return None
    if ring is not None and kv_layout is None:
        return None
    split = fresh_split(seg.host_cu_seqlens_q, seg.fresh_from)
    if split is None:
        return None
    j, t0 = split.num_paged_rows, split.num_paged_tokens
    q_f, k_f, v_f = q[t0:], k_new[t0:], v_new[t0:]
    quantized, cache_dtype = kv_layout is not None, k_cache.dtype
    if ring is not None:  # every fresh key exact for every query, or each query's own bound
        if split.flash_max_q_len > ring.window:
            res = _windowed_fresh_rows(q, k_new, v_new, seg, split, scale, window, stored_rows,
                                       ring.window, check)  # fmt: skip
            if res is None:
                return None
            return _with_paged_rows(res, q, k_cache, v_cache, seg, split, scale, window, out,
                                    kv_layout, check, ring)  # fmt: skip
        k_f, v_f = k_f.to(ring.k.dtype), v_f.to(ring.v.dtype)
        quantized, cache_dtype = False, ring.k.dtype
    elif quantized and stored_rows is not None and split.flash_max_q_len >= STORED_ROWS_MIN_LEN:
        # decide on stand-ins of the stored rows (no device work), load them only if used
        k_f = v_f = torch.empty(k_f.shape, dtype=torch.bfloat16, device="meta")
        quantized, cache_dtype = False, torch.bfloat16
    groups = equal_length_groups(seg.host_cu_seqlens_q[j:] - t0)
    why_not = sdpa_prefill_unsupported(
        q_f, k_f, v_f, groups, cache_dtype=cache_dtype, quantized_cache=quantized,
        sliding_window=window, device_type=q.device.type,
    )  # fmt: skip

    def flash_why_not() -> str | None:  # host facts only; the stand-ins answer for the rows
        return flash_prefill_unsupported(
            q_f, k_f, v_f, cache_dtype=cache_dtype, quantized_cache=quantized,
            sliding_window=window, max_q_len=split.flash_max_q_len, device_type=q.device.type,
        )  # fmt: skip

    why_not_flash = None if why_not is None else flash_why_not()
    if why_not_flash is not None:  # neither path applies: nothing loaded, nothing written
        return None
    if k_f.is_meta:
        k_f, v_f = stored_rows(t0, q.shape[0])
    done = False
    if why_not is None:
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        done = sdpa_prefill(q_f, k_f, v_f, groups, scale=scale, out=out[t0:]) is not None
    if not done:
        if why_not is None and flash_why_not() is not None:  # SDPA's first use failed
            return None
        res = flash_prefill(
            q_f, k_f, v_f, _fresh_cu_seqlens(seg, split), split.flash_max_q_len, scale=scale,
            sliding_window=window,
        )  # fmt: skip
        if res is None:
            return None
        return _with_paged_rows(res, q, k_cache, v_cache, seg, split, scale, window, out,
                                kv_layout, check, ring)  # fmt: skip
    return _with_paged_rows(None, q, k_cache, v_cache, seg, split, scale, window, out, kv_layout,
                            check, ring)  # fmt: skip


def _fresh_cu_seqlens(seg, split) -> torch.Tensor:
    """The fresh rows' device ``cu_seqlens`` ``[B - j + 1]``, from 0 (rebased on the device:
    no host round trip)."""
    cu = seg.cu_seqlens_q[split.num_paged_rows :]
    return cu - split.num_paged_tokens if split.num_paged_tokens else cu


def _with_paged_rows(res, q, k_cache, v_cache, seg, split, scale, window, out, kv_layout, check,
                     ring):  # fmt: skip
    """``out`` with the fresh rows' result ``res`` ``[T - t0, H, D]`` (None: ``out`` holds
    them already) and the paged rows ``[0, t0)`` from the paged kernel (over the ring's
    first ``j`` sequences, if any)."""
    j, t0 = split.num_paged_rows, split.num_paged_tokens
    if res is not None:
        if out is None and not j:
            return res
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        out[t0:].copy_(res)
    if j:
        paged_attention_prefill(
            q[:t0], k_cache, v_cache, seg.page_ids, seg.page_start[:j], seg.cu_seqlens_q[: j + 1],
            seg.kv_lens[:j], scale=scale, sliding_window=window, out=out[:t0],
            max_q_len=split.paged_max_q_len, kv_layout=kv_layout, check=check,
            ring=None if ring is None else ring._replace(base=ring.base[:j], lo=ring.lo[:j]),
        )  # fmt: skip
    return out


WINDOW_FRESH_MODES = ("0", "rows")


def window_fresh_mode() -> str:
    """``KVPLAN_WINDOW_FRESH`` (read on every call): how fresh prompts longer than
    kv_exact_window's window attend: ``rows`` (the default) the paged kernel over their
    stored rows read back as one-token bf16 pages, the new rows as the ring
    (`_stored_rows_with_ring`); ``0`` the paged kernel over the quantized pages and the
    per-step ring. H100, session 47 call D (bench/RESULTS.md), one 8K prompt of the 1B Llama:
    53.97 ms against 61.31 (the attention kernel 21.9 against 29.9 ms); the 32 x 8K x 256
    fp8 workload with a window of 64: 2,857 against 2,615 output tok/s (3,324 without it)."""
    mode = os.environ.get("KVPLAN_WINDOW_FRESH", "rows").strip()
    if mode not in WINDOW_FRESH_MODES:
        raise ValueError(f"KVPLAN_WINDOW_FRESH must be one of {WINDOW_FRESH_MODES}, got {mode!r}")
    return mode


def _windowed_fresh_rows(q, k_new, v_new, seg, split, scale, window, stored_rows, exact_window,
                         check=False):  # fmt: skip
    """The fresh rows ``[t0, T)`` of a segment with a ring whose window ``exact_window`` is
    shorter than some fresh prompt, by `window_fresh_mode`; None where that is ``0``, or
    without ``stored_rows``, or for prompts under ``STORED_ROWS_MIN_LEN`` (nothing is read
    back then)."""
    t0 = split.num_paged_tokens
    if stored_rows is None or split.flash_max_q_len < STORED_ROWS_MIN_LEN:
        return None
    if window_fresh_mode() == "0":
        return None
    k_st, v_st = stored_rows(t0, q.shape[0])
    return _stored_rows_with_ring(q[t0:], k_new[t0:], v_new[t0:], k_st, v_st, seg, split,
                                  scale, window, exact_window, check)  # fmt: skip


def _stored_rows_with_ring(q, k_new, v_new, k_st, v_st, seg, split, scale, window,
                           exact_window, check):  # fmt: skip
    """The paged kernel over fresh rows whose stored values ``k_st`` / ``v_st`` (bf16 ``[n,
    Hkv, D]``, read back) are one-token pages (page ids ``0 .. n - 1``, sequence b's from its
    first row) and whose new rows, in bf16, are the ring (position p of sequence b at row
    ``cu[b] + p``, from position 0, window ``exact_window``): each query's own bound, over
    plain bf16 tiles instead of quantized ones."""
    n, max_len = k_st.shape[0], split.flash_max_q_len
    cu = _fresh_cu_seqlens(seg, split)
    starts = cu[:-1].contiguous()
    ring = RecentRing(k_new.to(torch.bfloat16).contiguous(), v_new.to(torch.bfloat16).contiguous(),
                      starts, torch.zeros_like(starts), max_len, exact_window)  # fmt: skip
    ids = torch.arange(n, dtype=torch.int32, device=q.device)
    return paged_attention_prefill(
        q, k_st.unsqueeze(1), v_st.unsqueeze(1), ids, starts, cu,
        seg.kv_lens[split.num_paged_rows :], scale=scale, sliding_window=window,
        max_q_len=max_len, check=check, ring=ring,
    )  # fmt: skip
