"""Triton kernels for paged attention that read the page table directly.

Both kernels address the KV cache through a flat page table: the j-th page of sequence ``b``
is ``page_ids[page_start[b] + j]`` and key position ``p`` of that sequence lives in cache
block ``page_ids[page_start[b] + p // block_size]`` at row ``p % block_size``. The same kernel
therefore serves the ragged page table (``page_start = paged_kv_indptr[:-1]``) and the block
offsets table (``page_start = b * row_stride``).

GQA grouping: a program owns one KV head and packs the query heads that share it into the
rows of its tile, so each K/V tile is loaded once for the whole group::

    row r of a tile  ->  query token i = r // group_size, query head kvh * group_size + r % group_size

K/V tiles come from ``kvplan.ops._paged_kv_tiles.load_kv_tile``: plain caches are loaded as
they are, quantized (fp8 / fp4) pages are dequantized in registers (``KV_QUANT``, ``SF_KIND``,
``GROUP`` constexprs; ``sf_off`` and ``head_scales_offset`` locate the scales in a token
record).

Softmax is computed online in the log2 domain (``qk_scale = scale * log2(e)``); running maxima
start at -1e30 rather than -inf so that rows which see no key stay finite and end with
``l == 0``, which the epilogues turn into an all-zero output row.

Kernels:
- ``_decode_kernel``: grid ``(B, Hkv / HEADS, num_splits)`` (``(Hkv / HEADS, B,
  num_splits)`` with ``HEADS_FIRST``); one query per sequence, ``HEADS`` neighbouring KV heads
  a program (1 by default); the visible key range is cut into ``num_splits`` chunks (split-K).
  With one split it writes the output, else fp32 partials that ``_combine_kernel`` (grid
  ``(B, H)``) merges.
- ``_prefill_kernel``: grid ``(B, num_row_tiles, Hkv)``; varlen causal, tiles over query rows
  and keys; also serves decode rows with several query tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvplan.ops._dispatch import env_flag, triton_interpreting
from kvplan.ops._launch import jit
from kvplan.ops._paged_kv_tiles import (
    E2M1_F16,
    E2M1_F16_NIB,
    dequantize_kv_raw,
    head_scales_offset,
    kv_geometry,
    load_kv_groups,
    load_kv_raw,
    load_kv_tile,
    nibble_acc,
    nibble_query,
    query_f16,
)
from kvplan.ops._quant_triton import SF_KIND as _SF_KIND

# Stand-in for "no sliding window": far beyond any int32 position difference we produce.
NO_WINDOW = 1 << 30


@jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over logits ``s`` ``[TILE_M, TILE_N]`` (log2 domain): (probabilities,
    rescale of the old state, new running max, new denominator)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@jit
def _attend_tile(
    acc, m_i, l_i, start, q, row_pos, key_hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr,
    SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [start, start + TILE_N).

    ``MASKED`` tiles clip at ``key_hi`` and apply the causal / window mask per row; unmasked
    tiles are known (by the caller) to lie wholly inside every row's visible range.
    """
    offs_n = start + tl.arange(0, TILE_N)
    in_range = offs_n < key_hi
    if MASKED or BLOCK_SIZE % TILE_N != 0:
        # One page-table lookup per key: the tile may straddle pages.
        if MASKED:
            page = tl.load(page_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0)
        else:
            page = tl.load(page_ptr + offs_n // BLOCK_SIZE)
        page = page.to(tl.int64)
        row = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_rows = page * stride_kb + row * stride_kt  # [TILE_N] offsets of the keys' records
        v_rows = page * stride_vb + row * stride_vt
    else:
        # Unmasked tiles start at a multiple of TILE_N, so the tile sits inside one page.
        page = tl.load(page_ptr + start // BLOCK_SIZE).to(tl.int64)
        row = start % BLOCK_SIZE + tl.arange(0, TILE_N)
        k_rows = page * stride_kb + row * stride_kt
        v_rows = page * stride_vb + row * stride_vt
    return _attend_rows_tile(
        acc, m_i, l_i, q, k_rows, v_rows, in_range, offs_n, row_pos, window, k_ptr, v_ptr,
        ks_ptr, vs_ptr, qk_scale, TILE_N, HEAD_DIM, DOT_PRECISION, MASKED, KV_QUANT, SF_KIND,
        GROUP, False,
    )  # fmt: skip


@jit
def _attend_rows_tile(
    acc, m_i, l_i, q, k_rows, v_rows, in_range, offs_n, row_pos, window, k_ptr, v_ptr, ks_ptr,
    vs_ptr, qk_scale, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr,
    SF_KIND: tl.constexpr, GROUP: tl.constexpr, V_GROUPS: tl.constexpr,
):  # fmt: skip
    """`_attend_tile`'s step once the keys' record offsets ``k_rows`` / ``v_rows`` are looked
    up. ``MASKED``: keys out of ``in_range`` read nothing and the causal / window mask
    (``offs_n`` the keys' positions, ``row_pos``, ``window``) applies; otherwise those four
    are not read. ``V_GROUPS``: the accumulator is ``[groups, TILE_M, GROUP]`` and V's codes
    go to the MMA unscaled (`load_kv_groups`)."""
    k = load_kv_tile(
        k_ptr, ks_ptr, k_rows, in_range, q, TILE_N, HEAD_DIM, MASKED, KV_QUANT, SF_KIND, GROUP
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
    if MASKED:
        visible = (
            in_range[None, :]
            & (offs_n[None, :] <= row_pos[:, None])
            & (offs_n[None, :] > row_pos[:, None] - window)
        )
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
    if not V_GROUPS:
        v = load_kv_tile(
            v_ptr, vs_ptr, v_rows, in_range, q, TILE_N, HEAD_DIM, MASKED, KV_QUANT, SF_KIND, GROUP
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        # acc: [groups, TILE_M, GROUP]; V's scales go on the probabilities, one per key and
        # group, so the V codes reach the MMA as loaded.
        v, v_scale = load_kv_groups(v_ptr, vs_ptr, v_rows, q, TILE_N, HEAD_DIM, KV_QUANT,
                                    SF_KIND, GROUP)  # fmt: skip
        ps = p[None, :, :] * tl.trans(v_scale)[:, None, :]
        acc = acc * alpha[None, :, None] + tl.dot(ps.to(v.dtype), v,
                                                  input_precision=DOT_PRECISION)  # fmt: skip
    return acc, m_new, l_i


@jit
def _attend_range(
    acc, m_i, l_i, lo, hi, q, row_pos, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """Tiles of keys [lo, hi). The CPU interpreter (numpy >= 2.4) cannot take a runtime tensor
    as a ``range`` bound, so there the same step runs in a ``while`` loop; compiled kernels use
    the pipelined ``for`` loop."""
    if INTERPRET:
        start = lo
        while start < hi:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, start, q, row_pos, hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
                BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, MASKED, KV_QUANT, SF_KIND, GROUP,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(lo, hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, start, q, row_pos, hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
                BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, MASKED, KV_QUANT, SF_KIND, GROUP,
            )  # fmt: skip
    return acc, m_i, l_i


@jit
def _tile_rows(
    start, key_hi, page_ptr, stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """Offsets of the K and V records of keys [start, start + TILE_N) (one page-table lookup
    per key, masked to keys below ``key_hi``: a tile at or past it looks up page 0)."""
    offs_n = start + tl.arange(0, TILE_N)
    page = tl.load(page_ptr + offs_n // BLOCK_SIZE, mask=offs_n < key_hi, other=0).to(tl.int64)
    row = (offs_n % BLOCK_SIZE).to(tl.int64)
    return page * stride_kb + row * stride_kt, page * stride_vb + row * stride_vt


@jit
def _raw_kv_tile(
    start, key_hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb, stride_kt, stride_vb,
    stride_vt, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """The stored K and V bytes (`load_kv_raw`) of keys [start, start + TILE_N), every load
    masked to keys below ``key_hi`` (a tile at or past it loads nothing)."""
    in_range = start + tl.arange(0, TILE_N) < key_hi
    k_rows, v_rows = _tile_rows(start, key_hi, page_ptr, stride_kb, stride_kt, stride_vb,
                                stride_vt, BLOCK_SIZE, TILE_N)  # fmt: skip
    k = load_kv_raw(k_ptr, ks_ptr, k_rows, in_range, HEAD_DIM, True, KV_QUANT, SF_KIND, GROUP)
    v = load_kv_raw(v_ptr, vs_ptr, v_rows, in_range, HEAD_DIM, True, KV_QUANT, SF_KIND, GROUP)
    return k, v


@jit
def _attend_raw_tile(
    acc, m_i, l_i, q, k_raw, v_raw, qk_scale, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr,
    GROUP: tl.constexpr,
):  # fmt: skip
    """`_attend_tile` of a whole, unmasked tile whose stored bytes are already loaded."""
    k = dequantize_kv_raw(k_raw[0], k_raw[1], q, TILE_N, HEAD_DIM, KV_QUANT, SF_KIND, GROUP)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
    v = dequantize_kv_raw(v_raw[0], v_raw[1], q, TILE_N, HEAD_DIM, KV_QUANT, SF_KIND, GROUP)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@jit
def _ahead_step(
    acc, m_i, l_i, start, hi, q, k_cur, v_cur, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
    V_GROUPS: tl.constexpr,
):  # fmt: skip
    """One step of `_attend_range_ahead`: issue the next tile's loads (``MODE`` 1: its
    stored bytes; 2: its page-table lookup), then attend tile ``start`` from what the step
    before loaded (``k_cur`` / ``v_cur``); returns the state and the next tile's values."""
    if MODE == 1:
        k_next, v_next = _raw_kv_tile(start + TILE_N, hi, page_ptr, k_ptr, v_ptr, ks_ptr,
                                      vs_ptr, stride_kb, stride_kt, stride_vb, stride_vt,
                                      BLOCK_SIZE, TILE_N, HEAD_DIM, KV_QUANT, SF_KIND,
                                      GROUP)  # fmt: skip
        acc, m_i, l_i = _attend_raw_tile(acc, m_i, l_i, q, k_cur, v_cur, qk_scale, TILE_N,
                                         HEAD_DIM, DOT_PRECISION, KV_QUANT, SF_KIND,
                                         GROUP)  # fmt: skip
    else:
        k_next, v_next = _tile_rows(start + TILE_N, hi, page_ptr, stride_kb, stride_kt,
                                    stride_vb, stride_vt, BLOCK_SIZE, TILE_N)  # fmt: skip
        # whole tiles: unmasked (in_range, positions, row_pos and window are not read)
        acc, m_i, l_i = _attend_rows_tile(
            acc, m_i, l_i, q, k_cur, v_cur, k_cur, k_cur, k_cur, 0, k_ptr, v_ptr, ks_ptr,
            vs_ptr, qk_scale, TILE_N, HEAD_DIM, DOT_PRECISION, False, KV_QUANT, SF_KIND, GROUP,
            V_GROUPS,
        )  # fmt: skip
    return acc, m_i, l_i, k_next, v_next


@jit
def _attend_range_ahead(
    acc, m_i, l_i, lo, hi, q, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, KV_QUANT: tl.constexpr,
    SF_KIND: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """`_attend_range` over whole, unmasked tiles with part of each tile's loading one step
    ahead (``PREFETCH_MODES``):

    * ``MODE`` 1 (quantized caches): the tile's stored bytes, in registers (register double
      buffering: a tile's global loads are in flight while the previous tile is dequantized
      and multiplied; the compiler pipelines only the scales of these loads on its own). The
      same values and order of operations as mode 0.
    * ``MODE`` 2: the tile's page-table lookup, so a step's K / V loads depend on no load of
      the same step and the compiler's software pipeline spends all its stages on K / V
      buffers; an e4m3 / int8 V goes to the MMA by scale group (``V_GROUPS``; the e2m1 nibble
      pairs split by group decode slowly, so an e2m1 V stays dequantized in registers).
    """
    TILE_M: tl.constexpr = acc.shape[0]
    V_GROUPS: tl.constexpr = MODE >= 2 and (KV_QUANT == 1 or KV_QUANT == 3)
    if MODE == 1:
        k_next, v_next = _raw_kv_tile(lo, hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb,
                                      stride_kt, stride_vb, stride_vt, BLOCK_SIZE, TILE_N,
                                      HEAD_DIM, KV_QUANT, SF_KIND, GROUP)  # fmt: skip
    else:
        k_next, v_next = _tile_rows(lo, hi, page_ptr, stride_kb, stride_kt, stride_vb,
                                    stride_vt, BLOCK_SIZE, TILE_N)  # fmt: skip
    if V_GROUPS:  # the accumulator by scale group (`_attend_rows_tile`)
        acc = tl.permute(tl.reshape(acc, [TILE_M, HEAD_DIM // GROUP, GROUP]), (1, 0, 2))
    if INTERPRET:
        start = lo
        while start < hi:
            acc, m_i, l_i, k_next, v_next = _ahead_step(
                acc, m_i, l_i, start, hi, q, k_next, v_next, page_ptr, k_ptr, v_ptr, ks_ptr,
                vs_ptr, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, BLOCK_SIZE,
                TILE_N, HEAD_DIM, DOT_PRECISION, KV_QUANT, SF_KIND, GROUP, MODE, V_GROUPS,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(lo, hi, TILE_N):
            acc, m_i, l_i, k_next, v_next = _ahead_step(
                acc, m_i, l_i, start, hi, q, k_next, v_next, page_ptr, k_ptr, v_ptr, ks_ptr,
                vs_ptr, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, BLOCK_SIZE,
                TILE_N, HEAD_DIM, DOT_PRECISION, KV_QUANT, SF_KIND, GROUP, MODE, V_GROUPS,
            )  # fmt: skip
    if V_GROUPS:
        acc = tl.reshape(tl.permute(acc, (1, 0, 2)), [TILE_M, HEAD_DIM])
    return acc, m_i, l_i


@jit
def _ring_tile(
    acc, m_i, l_i, start, hi, q, row_pos, ring_k_ptr, ring_v_ptr, ring_base, ring_size,
    stride_rt, window, qk_scale, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_attend_tile` over keys [start, start + TILE_N) (clipped at ``hi``) read from the
    recent-window ring: key position ``p`` is row ``ring_base + p % ring_size`` of the ring
    (``stride_rt`` elements a row), stored in q's dtype."""
    offs_n = start + tl.arange(0, TILE_N)
    in_range = offs_n < hi
    rows = (ring_base + offs_n % ring_size).to(tl.int64) * stride_rt
    return _attend_rows_tile(
        acc, m_i, l_i, q, rows, rows, in_range, offs_n, row_pos, window, ring_k_ptr,
        ring_v_ptr, ring_k_ptr, ring_v_ptr, qk_scale, TILE_N, HEAD_DIM, DOT_PRECISION, True, 0,
        0, 1, False,
    )  # fmt: skip


@jit
def _attend_ring(
    acc, m_i, l_i, lo, hi, q, row_pos, ring_k_ptr, ring_v_ptr, ring_base, ring_size,
    stride_rt, window, qk_scale, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Masked tiles of keys [lo, hi) from the recent-window ring (`_ring_tile`); a ``while``
    loop under the CPU interpreter, as in `_attend_range`."""
    if INTERPRET:
        start = lo
        while start < hi:
            acc, m_i, l_i = _ring_tile(
                acc, m_i, l_i, start, hi, q, row_pos, ring_k_ptr, ring_v_ptr, ring_base,
                ring_size, stride_rt, window, qk_scale, TILE_N, HEAD_DIM, DOT_PRECISION,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(lo, hi, TILE_N):
            acc, m_i, l_i = _ring_tile(
                acc, m_i, l_i, start, hi, q, row_pos, ring_k_ptr, ring_v_ptr, ring_base,
                ring_size, stride_rt, window, qk_scale, TILE_N, HEAD_DIM, DOT_PRECISION,
            )  # fmt: skip
    return acc, m_i, l_i


@jit
def _attend_rows(
    q, row_pos, pos_min, pos_max, key_lo, key_hi, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
    ring_k_ptr, ring_v_ptr, ring_base, ring_lo, ring_size, ring_window, stride_rt,
    TILE_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr, PREFETCH: tl.constexpr,
    RING: tl.constexpr,
):  # fmt: skip
    """Online-softmax attention of ``TILE_M`` query rows over keys [key_lo, key_hi).

    q: [TILE_M, HEAD_DIM] in the cache dtype; row_pos: [TILE_M] int32 absolute positions
    (-1 = padding row); pos_min / pos_max: the smallest / largest position of a real row;
    page_ptr: page_ids + page_start[b]; k_ptr / v_ptr: cache + kv_head * head stride.
    Keys [max(key_lo, pos_max - window + 1), pos_min] are visible to every real row, so whole
    tiles there (starting at a multiple of TILE_N) skip the mask; the head and tail of the
    range are masked. ``PREFETCH``: how the whole tiles load (``PREFETCH_MODES``; 1 and 2
    in `_attend_range_ahead`).

    ``RING``: the recent-window ring (`_attend_ring`: ``ring_k_ptr`` / ``ring_v_ptr`` at this
    head, row ``ring_base + p % ring_size``): the row at ``row_pos`` reads keys at positions
    ``>= max(row_pos - ring_window + 1, ring_lo)`` from the ring, older ones from the pages.
    With ``a = max(ring_lo, pos_min - ring_window + 1)`` (the first row's bound, the lowest),
    the pages serve [key_lo, a) to every row (whole tiles unmasked) and [a, pos_max -
    ring_window + 1) to the rows whose own bound is past the key (masked tiles, the causal
    mask moved back by ``ring_window``); the ring serves [a, key_hi) under the window
    ``min(window, ring_window)``. (A long chunk's rows thus read ~``ring_window + TILE_M``
    ring keys, not the whole chunk.)

    Returns the unnormalized accumulator [TILE_M, HEAD_DIM] (fp32), the running maximum m
    (log2 domain) and the running denominator l, both [TILE_M] fp32.
    """
    m_i = tl.full([TILE_M], -1.0e30, tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    ring_hi = key_hi
    straddle_hi = key_hi
    if RING:  # every row reads the pages up to the first row's own ring bound
        ring_from = tl.maximum(ring_lo, pos_min - ring_window + 1)
        key_hi = tl.minimum(key_hi, tl.maximum(ring_from, key_lo))
        straddle_hi = tl.minimum(ring_hi, tl.maximum(pos_max - ring_window + 1, key_hi))
    full_lo = tl.maximum(key_lo, pos_max - window + 1)
    full_lo = tl.minimum((full_lo + TILE_N - 1) // TILE_N * TILE_N, key_hi)  # tile-aligned
    full_hi = tl.maximum(tl.minimum(pos_min + 1, key_hi), full_lo)
    full_hi = full_lo + (full_hi - full_lo) // TILE_N * TILE_N  # whole tiles only
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, key_lo, full_lo, q, row_pos, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
        stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
        BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, True, INTERPRET, KV_QUANT, SF_KIND, GROUP,
    )  # fmt: skip
    if PREFETCH >= 2 or (PREFETCH == 1 and KV_QUANT != 0):
        acc, m_i, l_i = _attend_range_ahead(
            acc, m_i, l_i, full_lo, full_hi, q, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
            BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, INTERPRET, KV_QUANT, SF_KIND, GROUP,
            PREFETCH,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, full_lo, full_hi, q, row_pos, page_ptr, k_ptr, v_ptr, ks_ptr,
            vs_ptr, stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
            BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, False, INTERPRET, KV_QUANT, SF_KIND,
            GROUP,
        )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, full_hi, key_hi, q, row_pos, page_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
        stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
        BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, True, INTERPRET, KV_QUANT, SF_KIND, GROUP,
    )  # fmt: skip
    if RING:
        # keys past ring_lo that a row's own bound leaves to the pages: row r reads key j
        # there iff j <= row_pos - ring_window (and inside the model's window)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, key_hi, straddle_hi, q, row_pos - ring_window, page_ptr, k_ptr,
            v_ptr, ks_ptr, vs_ptr, stride_kb, stride_kt, stride_vb, stride_vt,
            window - ring_window, qk_scale, BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, True,
            INTERPRET, KV_QUANT, SF_KIND, GROUP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_ring(
            acc, m_i, l_i, key_hi, ring_hi, q, row_pos, ring_k_ptr, ring_v_ptr, ring_base,
            ring_size, stride_rt, tl.minimum(window, ring_window), qk_scale, TILE_N, HEAD_DIM,
            DOT_PRECISION, INTERPRET,
        )  # fmt: skip
    return acc, m_i, l_i


@jit
def _ring_of(ring_base_ptr, ring_lo_ptr, b, kv_len, RING: tl.constexpr):
    """Sequence b's ring row of position 0 (mod the ring size) and its first ring position;
    without ``RING`` (0, kv_len): every key from the pages."""
    if RING:
        return tl.load(ring_base_ptr + b).to(tl.int64), tl.load(ring_lo_ptr + b)
    return tl.zeros([], tl.int64), kv_len


@jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, page_ids_ptr, page_start_ptr, kv_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_oh, group_size, window, qk_scale, num_splits, sf_off,
    ring_k_ptr, ring_v_ptr, ring_base_ptr, ring_lo_ptr, ring_size, ring_window, stride_rt,
    stride_rh,
    TILE_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr, KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr,
    GROUP: tl.constexpr, PREFETCH: tl.constexpr, HEADS_FIRST: tl.constexpr,
    HEADS: tl.constexpr, RING: tl.constexpr,
):  # fmt: skip
    """Grid (B, Hkv / HEADS, num_splits), or (Hkv / HEADS, B, num_splits) with
    ``HEADS_FIRST``. q/out: [B, H, D]; caches [num_blocks, BLOCK_SIZE, Hkv, D]; page_ids int32
    flat, page_start / kv_lens int32 [B]; partials (SPLIT only): fp32 part_acc [B, H, S, D],
    part_m / part_l [B, H, S].

    ``HEADS`` > 1: a program takes that many neighbouring KV heads as one head of
    ``HEADS * HEAD_DIM`` columns (their value runs, and their scale runs, are contiguous in a
    token's record), so each key's load is one run of all of them; its query tile is block
    diagonal (row r, of KV head r // group_size, holds its query in that head's columns and
    zeros elsewhere), so each row's logits are its own head's, and each row keeps its own
    head's columns of the value product.

    ``RING``: the recent-window ring: ``ring_k`` / ``ring_v`` ``[rows, Hkv, D]`` in q's dtype
    (``stride_rt`` / ``stride_rh`` elements a row / head), sequence b's position p at row
    ``ring_base[b] + p % ring_size`` for ``p >= ring_lo[b]`` (int32 [B]). 0: no ring; 2: the
    pages up to ``ring_lo`` in splits ``0 .. num_splits - 2`` (the same code as without the
    ring: folding the ring's tiles into this program made it 14 % slower on an H100); 3 (grid
    ``(B, Hkv / HEADS, 1)``): the ring's keys into partial ``num_splits - 1``."""
    if HEADS_FIRST:
        b = tl.program_id(1)
        kvh = tl.program_id(0) * HEADS
        num_kv_heads = tl.num_programs(0) * HEADS
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1) * HEADS
        num_kv_heads = tl.num_programs(1) * HEADS
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    page_start = tl.load(page_start_ptr + b)
    # The query sits at position kv_len - 1 and sees keys kv_len - window .. kv_len - 1;
    # split s takes the s-th chunk (a whole number of tiles) of that range. With the ring
    # (RING 2 / 3) the pages end where the ring starts, the last of the num_splits partials
    # is the ring's (RING 3: its own launch) and the others share the pages.
    lo = tl.maximum(kv_len - window, 0)
    page_end = kv_len
    page_splits = num_splits
    ring_base, ring_lo = _ring_of(ring_base_ptr, ring_lo_ptr, b, kv_len, RING != 0)
    if RING != 0:
        ring_lo = tl.maximum(ring_lo, kv_len - ring_window)  # the query's own bound
        page_end = tl.maximum(tl.minimum(kv_len, ring_lo), lo)
        page_splits = num_splits - 1
    if RING == 3:
        split = num_splits - 1
    per_split = (page_end - lo + page_splits - 1) // page_splits
    chunk = (per_split + TILE_N - 1) // TILE_N * TILE_N
    key_lo = tl.minimum(lo + split * chunk, page_end)
    key_hi = tl.minimum(key_lo + chunk, page_end)

    HD: tl.constexpr = HEADS * HEAD_DIM  # the program's columns
    offs_g = tl.arange(0, TILE_M)
    offs_d = tl.arange(0, HD)
    g_ok = offs_g < group_size * HEADS
    heads = (kvh * group_size + offs_g).to(tl.int64)
    if HEADS == 1:
        col = offs_d[None, :]  # [1, HD]: a row's columns of q / out
        keep = g_ok[:, None]
    else:  # row r's own head's columns, head-local
        col = offs_d[None, :] - (offs_g // group_size * HEAD_DIM)[:, None]  # [TILE_M, HD]
        keep = g_ok[:, None] & (col >= 0) & (col < HEAD_DIM)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh  # [TILE_M, 1]
    q = tl.load(q_rows + col, mask=keep, other=0.0)
    if KV_QUANT >= E2M1_F16:  # fp16 tiles (E2M1_F16, E2M1_F16_NIB)
        q, qk_scale = query_f16(q, qk_scale)
    if KV_QUANT == E2M1_F16_NIB:  # the tiles' column order and 2^-14
        q, qk_scale = nibble_query(q, qk_scale)
    row_pos = tl.where(g_ok, kv_len - 1, -1)
    sf_head = head_scales_offset(kvh, HEAD_DIM, GROUP, SF_KIND)
    if RING == 3:  # the ring's keys only (masked tiles), into the last partial
        m_i = tl.full([TILE_M], -1.0e30, tl.float32)
        l_i = tl.zeros([TILE_M], tl.float32)
        acc = tl.zeros([TILE_M, HD], tl.float32)
        acc, m_i, l_i = _attend_ring(
            acc, m_i, l_i, tl.maximum(lo, ring_lo), kv_len, q, row_pos,
            ring_k_ptr + kvh * stride_rh, ring_v_ptr + kvh * stride_rh, ring_base, ring_size,
            stride_rt, window, qk_scale, TILE_N, HD, DOT_PRECISION, INTERPRET,
        )  # fmt: skip
    else:  # the pages (up to the ring's first key with RING 2)
        acc, m_i, l_i = _attend_rows(
            q, row_pos, kv_len - 1, kv_len - 1, key_lo, key_hi, page_ids_ptr + page_start,
            k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh,
            k_ptr + sf_off + sf_head, v_ptr + sf_off + sf_head,
            stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
            ring_k_ptr, ring_v_ptr, ring_base, ring_lo, ring_size, ring_window, stride_rt,
            TILE_M, BLOCK_SIZE, TILE_N, HD, DOT_PRECISION, INTERPRET, KV_QUANT, SF_KIND, GROUP,
            PREFETCH, False,
        )  # fmt: skip
    if KV_QUANT == E2M1_F16_NIB:  # back in order, V's 2^-14 off
        acc = nibble_acc(acc)
    if SPLIT:
        # Partial row index (b * H + head) * S + split.
        num_heads = num_kv_heads * group_size
        part_row = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [TILE_M]
        acc_off = part_row[:, None] * HEAD_DIM + col
        tl.store(part_acc_ptr + acc_off, acc, mask=keep)
        tl.store(part_m_ptr + part_row, m_i, mask=g_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=g_ok)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + col
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=keep)


@jit
def _combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Grid (B, H): merge the split partials (fp32 [B, H, S, D] and [B, H, S]) into out."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    base = (b * num_heads + h) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    acc_off = (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(part_acc_ptr + acc_off, mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # [SPLITS_PAD]; padding splits get weight 0
    den = tl.sum(w * lsum, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, page_ids_ptr, page_start_ptr, cu_seqlens_q_ptr, kv_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, group_size, window, qk_scale, sf_off,
    ring_k_ptr, ring_v_ptr, ring_base_ptr, ring_lo_ptr, ring_size, ring_window, stride_rt,
    stride_rh,
    TILE_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    KV_QUANT: tl.constexpr, SF_KIND: tl.constexpr, GROUP: tl.constexpr, PREFETCH: tl.constexpr,
    RING: tl.constexpr,
):  # fmt: skip
    """Grid (B, num_row_tiles, Hkv). q/out: [T, H, D]; cu_seqlens_q int32 [B + 1]; the rest as
    in ``_decode_kernel``. Row r of tile t is token (t * TILE_M + r) // group_size of the
    sequence and query head kvh * group_size + (t * TILE_M + r) % group_size."""
    b = tl.program_id(0)
    # Launch the last (longest causal) row tiles first so that the short ones fill the tail.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    page_start = tl.load(page_start_ptr + b)
    first_pos = kv_len - q_len  # absolute position of the sequence's first query token

    rows = tile * TILE_M + tl.arange(0, TILE_M)
    tok = rows // group_size
    head = kvh * group_size + rows % group_size
    row_ok = tok < q_len
    row_pos = tl.where(row_ok, first_pos + tok, -1)
    # Key range of the whole tile: from the first row's window start to the last row's key.
    # Tiles past the end of the sequence get an empty range and store nothing.
    tok_first = (tile * TILE_M) // group_size
    tok_last = tl.minimum((tile * TILE_M + TILE_M - 1) // group_size, q_len - 1)
    key_lo = tl.maximum(first_pos + tok_first - window + 1, 0)
    key_hi = tl.where(tok_first < q_len, first_pos + tok_last + 1, key_lo)

    offs_d = tl.arange(0, HEAD_DIM)
    t64 = (q_start + tok).to(tl.int64)
    h64 = head.to(tl.int64)
    q_off = t64[:, None] * stride_qt + h64[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    sf_head = head_scales_offset(kvh, HEAD_DIM, GROUP, SF_KIND)
    ring_base, ring_lo = _ring_of(ring_base_ptr, ring_lo_ptr, b, kv_len, RING)
    acc, m_i, l_i = _attend_rows(
        q, row_pos, first_pos + tok_first, first_pos + tok_last, key_lo, key_hi,
        page_ids_ptr + page_start, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh,
        k_ptr + sf_off + sf_head, v_ptr + sf_off + sf_head,
        stride_kb, stride_kt, stride_vb, stride_vt, window, qk_scale,
        ring_k_ptr + kvh * stride_rh, ring_v_ptr + kvh * stride_rh, ring_base, ring_lo,
        ring_size, ring_window, stride_rt,
        TILE_M, BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, INTERPRET, KV_QUANT, SF_KIND, GROUP,
        PREFETCH, RING,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = t64[:, None] * stride_ot + h64[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Launchers (inputs are validated by kvplan.ops.paged_attention before they get here).
# ---------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


PREFETCH_MODES = (0, 1, 2)
"""How a launch's whole, unmasked key tiles load (the ``PREFETCH`` constexpr): 0 as the masked
ones (`_attend_range`); 1 a quantized tile's stored bytes one step ahead in registers
(`_attend_range_ahead`); 2 the tile's page-table lookup one step ahead, and an fp8 / int8 V
by scale group with its scales on the probabilities (also `_attend_range_ahead`). A mode 3
(an fp8 / int8 K's logits by scale group: fp16 MMAs of the codes as stored, the keys' scales
on the logits) compiled to fewer instructions (783 against 921) but measured slower on the
H200 (bench/RESULTS.md, session 26: 147.4 against 135.8 us a call at 32 x 8K, the long
workload's decode step 3.53 against 3.31 ms) and was removed."""


def _env_int(name: str, choices: tuple[int, ...], said: str) -> int | None:
    """The int set in the environment variable ``name`` (one of ``choices``, else an error
    saying it must be ``said``), or None where it is unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) not in choices:
        raise ValueError(f"{name} must be {said}, got {value!r}")
    return int(value)


def _env_prefetch(name: str = "KVPLAN_QUANT_PREFETCH") -> int | None:
    return _env_int(name, (0, 1, 2), "0, 1 or 2")


QUANT_PREFETCH: int | None = _env_prefetch()
"""Every launch's ``PREFETCH_MODES`` entry (``KVPLAN_QUANT_PREFETCH`` = 0 / 1 / 2 at import),
or None (the default): per format and kernel as ``DECODE_PREFETCH`` says. On sm_90 Triton
software-pipelines only the scale loads of the dequantizing kernels' mode-0 loop (cp.async),
not the value bytes (bench/RESULTS.md, session 10)."""

DECODE_PREFETCH = {"e2m1": 1, "e2m1_f16": 2, "e4m3": 2, "int8": 2}
"""Decode launches' default ``PREFETCH_MODES`` entry by `decode_key` (absent: 0). fp4 pages read
as fp16 tiles (``"e2m1_f16"``) take mode 2: 128 registers (session 23, 32 x 8K, 4 splits: 151.4
us in mode 2, 152.3 in mode 0; with 3 splits mode 1 153.1). Measured on the H200
(bench/RESULTS.md), one layer at 32 x 8K context: fp4 decode 254 -> 229 us with mode 1 (session
11), 468 us with mode 2 (session 20: its grouped e2m1 decode is slow); session 20
(``bench_quant_decode.py --graph --prefetch 2``) fp8 157.0 -> 143.7 us and int8 185.8 -> 153.6
us with mode 2 at (64, 2, 3), the long fp8 workload's decode step 3.647 -> 3.435 ms. Prefill
launches keep mode 0: mode 2 in every launch made that workload's mixed (prefill) steps 1.59 ->
1.73 s."""


DECODE_PREFETCH_OVERRIDE: int | None = _env_prefetch("KVPLAN_DECODE_PREFETCH")
"""``KVPLAN_DECODE_PREFETCH`` = 0 / 1 / 2 at import: every quantized decode launch's mode
instead of ``DECODE_PREFETCH``'s (A/B runs of whole engines; prefill launches keep theirs)."""


def _prefetch(prefetch: int | bool | None, kv_layout, decode: bool, key=None) -> int:
    """The ``PREFETCH`` of a launch; ``key``: the decode's `decode_key` (None: the layout's
    ``quantized_dtype``)."""
    if prefetch is not None:
        mode = int(prefetch)
        if mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
        return mode
    if QUANT_PREFETCH is not None:
        return QUANT_PREFETCH
    if not decode or kv_layout is None:
        return 0
    if DECODE_PREFETCH_OVERRIDE is not None:
        return DECODE_PREFETCH_OVERRIDE
    return DECODE_PREFETCH.get(key or kv_layout.quantized_dtype, 0)


FP4_F16_TILES = env_flag("KVPLAN_FP4_F16", True)
"""Decode launches over e2m1 pages with e4m3 scales (``kv_format="fp4"``) and bf16 / fp16
queries read the pages as fp16 tiles (``E2M1_F16``: the nibbles unpacked four bytes a
register, the scales applied in fp16, fp16 query and probabilities) when True (the default;
``KVPLAN_FP4_F16=0`` at import: bf16 tiles). The keys' values are the same; the result differs
from the bf16 tiles by the probabilities' rounding (fp16's 11 bits against bf16's 8). Their
launches have their own defaults (`decode_key` ``"e2m1_f16"``: mode 2, 128 registers, so 8
programs an SM). sm_90 main loop (64 keys, 2 warps): 1,026 instructions at 128 registers in
mode 2, against 1,579 at 244 with bf16 tiles in mode 1. H200, one call at 32 x 8K (bench/
RESULTS.md, session 23): 150.6-151.5 us (4 splits) against 189.1-190.1 us; the long
workload's fp4 decode step 3.603 ms against 4.260."""

FP4_NIBBLE_TILES = env_flag("KVPLAN_FP4_NIBBLES", True)
"""Where `FP4_F16_TILES` applies, read the tiles in nibble order (``E2M1_F16_NIB``; True, the
default; ``KVPLAN_FP4_NIBBLES=0`` at import: in order): each int32 word's nibbles ``i`` and
``i + 4`` placed as one fp16 pair by four integer operations, and the values left 2^-14 small
so that one fp16 multiply (by the scale) makes them; the query is read and the output written
in that order, and the 2^14 goes on the score scale and the accumulator (powers of two:
exact). The same products in another order of the head dimensions. sm_90 main loop (mode 2,
64 keys, 2 warps): 774 instructions at the 128-register cap (no spills), against 1,026 for
``E2M1_F16``. H200 (bench/RESULTS.md, session 24): one call at 32 x 8K 139.2 us against 150.1
(fp8 136.4); the long workload's fp4 decode step 3.401 ms against 3.591, 3,224 output tok/s
against 3,120 (fp8 3,286)."""


def _heads_from_env() -> int | None:
    return _env_int("KVPLAN_DECODE_HEADS", (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16")


DECODE_HEADS: int | None = _heads_from_env()
"""KV heads a decode program takes side by side (``_decode_kernel``'s ``HEADS``) by the
environment: ``KVPLAN_DECODE_HEADS=n`` at import makes it n wherever `decode_heads` allows,
for every launch that names none (A/B runs of whole engines; ``heads=`` per launch), with the
tiling of ``kvplan.ops._paged_kv_tiles.DECODE_TILING_HEADS``; unset (None), launches follow
`DECODE_HEADS_AUTO`."""


DECODE_HEADS_AUTO: dict[str, tuple[int, int]] = {
    "e4m3": (2, 4096),
    "e2m1_f16": (2, 1024),
    "int8": (2, 4096),
}
"""Per ``decode_key``: ``(heads, bound)``, the KV heads a program of a launch that names none
(and no ``KVPLAN_DECODE_HEADS``) takes when its host bound on the key count (``max_kv_len``)
exceeds ``bound`` and its (sequence, head group) programs number at least
`DECODE_HEADS_MIN_PROGRAMS`; 1 otherwise. fp8 pages, H100 (bench/RESULTS.md, session 37; CUDA-graph
medians of one call, default launch plans): two heads at 32 x 8K 146.4 / 147.3 us against
166.7 / 168.9, at 64 x 4K 144.0 against 153.9, but at 64 x 1K 48.1 against 42.2 and at 64 x
320 23.5 against 15.3 (half the programs, twice the tiles each); in the long workload's
decode graph (32 x ~8.2K) the decode kernels took 2,337.5 us a step against 2,657.5.
Session 38 (H100, one call, `DECODE_TILING_HEADS`' tilings): fp4 (fp16 tiles in nibble order)
at 64 x 1K 40.8 against 41.5 us, 2K 70.2 against 73.8, 4K 127.1 against 140.2; int8 at 64 x
1K 53.7 against 44.0, 2K 85.1 against 79.1, 4K 154.3 against 153.4 (32 x 8K, session 37:
155.9 against 166.6). The long workload's decode step (32 x 8,192 x 256, one call): fp4 3.404
against 3.561 ms (3,291 against 3,244 output tok/s), int8 3.923 against 4.049 (3,164 against
3,156); fp8 3.718 (3,193). The bounds are also the engine's decode-graph context tiers
(`decode_context_bounds`)."""

DECODE_HEADS_MIN_PROGRAMS = 128
"""Fewest (sequence, head group) programs, before splits, for which `DECODE_HEADS_AUTO`
applies: the measured wins had 128 (32 sequences x 4 pairs of KV heads) and 256; with fewer
sequences the split rule's 256 keys a split leaves a two-heads launch half the programs of a
one-head one (1 x 8K: 128 against 256), unmeasured, so those launches keep one head."""


MAX_HEADS_COLUMNS = 256  # widest tile (heads x head_dim) a decode program takes
MAX_HEADS_ROW_BYTES = 512  # widest row of a plain cache's tile, in bytes


def auto_heads(key: str | None, max_kv_len: int | None, pairs: int | None = None) -> int:
    """KV heads a program for a launch that names none: ``KVPLAN_DECODE_HEADS`` when set, else
    `DECODE_HEADS_AUTO`'s entry for ``key`` when ``max_kv_len`` exceeds its bound and the
    launch's (sequence, KV head) ``pairs`` (None: not checked) make at least
    `DECODE_HEADS_MIN_PROGRAMS` programs at that count, else 1.

    >>> auto_heads("e4m3", 8192, 256), auto_heads("e4m3", 4096, 256), auto_heads(None, 8192)
    (2, 1, 1)
    >>> auto_heads("e4m3", 8192, 8)  # one sequence x 8 KV heads: 4 programs
    1
    """
    if DECODE_HEADS is not None:
        return DECODE_HEADS
    heads, bound = DECODE_HEADS_AUTO.get(key, (1, 0))
    if max_kv_len is None or max_kv_len <= bound:
        return 1
    if pairs is not None and pairs // heads < DECODE_HEADS_MIN_PROGRAMS:
        return 1
    return heads


def decode_context_bounds(key: str | None) -> tuple[int, ...]:
    """The host bounds on the key count (``max_kv_len``) at which the default decode launch
    of ``key`` (`decode_key`) changes (`auto_heads`): a CUDA graph captured for a bound
    replays correctly for any shorter context, but only one captured at each of these (and at
    the longest) keeps every length on its own default launch.

    >>> decode_context_bounds("e4m3"), decode_context_bounds(None)
    ((4096,), ())
    """
    if DECODE_HEADS is not None or key not in DECODE_HEADS_AUTO:
        return ()
    return (DECODE_HEADS_AUTO[key][1],)


def decode_heads(
    geo, head_dim: int, group_size: int, heads: int | None, element_size: int = 2,
    key: str | None = None, max_kv_len: int | None = None, batch: int | None = None,
) -> int:  # fmt: skip
    """KV heads per decode program: ``heads`` (None: `auto_heads` of the launch's ``key``,
    ``max_kv_len`` and ``batch`` sequences). More than one
    needs the heads' value runs side by side in a record (a plain cache's head stride equal to
    ``head_dim``), a KV head count it divides, at most 16 query rows a program, and a tile
    that fits an SM's shared memory: at most `MAX_HEADS_COLUMNS` columns, and for a plain
    cache of ``element_size``-byte values at most `MAX_HEADS_ROW_BYTES` a key (an fp32
    cache's two 128-wide heads at 64 keys x 5 stages need 283 KB on sm_90, more than the
    227 KB an SM has). A default that does not fit falls back to 1, an explicit ``heads``
    raises."""
    given = heads is not None
    pairs = None if batch is None else batch * geo.num_kv_heads
    heads = heads if given else auto_heads(key, max_kv_len, pairs)
    if heads == 1:
        return 1
    valid = isinstance(heads, int) and heads in (2, 4, 8, 16)
    columns = heads * head_dim if valid else 0
    plain = geo.kv_quant == 0
    fits = (
        valid and geo.num_kv_heads % heads == 0 and heads * group_size <= 16
        and columns <= MAX_HEADS_COLUMNS
        and (not plain or columns * element_size <= MAX_HEADS_ROW_BYTES)
        and (not plain or (geo.stride_kh == head_dim and geo.stride_vh == head_dim))
    )  # fmt: skip
    if fits:
        return heads
    if given:
        raise ValueError(
            f"heads={heads!r} does not fit: it must be 1, 2, 4, 8 or 16, divide the "
            f"{geo.num_kv_heads} KV heads, keep heads x {group_size} query heads <= 16 and "
            f"heads x {head_dim} columns <= {MAX_HEADS_COLUMNS} (a plain cache's: <= "
            f"{MAX_HEADS_ROW_BYTES} bytes, {element_size} a value, its heads contiguous)"
        )
    return 1


DECODE_HEADS_FIRST = env_flag("KVPLAN_DECODE_HEADS_FIRST", False)
"""Decode launches order their programs KV head first (grid ``(Hkv, B, num_splits)``) when
True (``KVPLAN_DECODE_HEADS_FIRST=1`` at import; ``heads_first=`` per launch): the programs
of one sequence's heads then run side by side (the caches interleave a token's heads). Off
(sequence first): on the H100 (bench/RESULTS.md, session 36) it was 1-4 % faster at 32 x 8K
(bf16 190.7 vs 196.8 us, fp8 166.3 vs 169.1), level at 64 x 320, the same DRAM bytes either
way; the GPU tests of the decode kernel pass with it (session 37: 23 passed)."""


def _kv_quant(geo, q, k_cache, v_cache) -> int:
    """The decode kernel's ``KV_QUANT``: ``E2M1_F16`` where `FP4_F16_TILES` applies (the
    value runs 4-byte aligned for the word loads; ``E2M1_F16_NIB`` with
    `FP4_NIBBLE_TILES`), else the geometry's."""
    if not (FP4_F16_TILES and geo.kv_quant == 2 and geo.sf_kind == _SF_KIND["e4m3"]):
        return geo.kv_quant
    if q.dtype not in (torch.bfloat16, torch.float16):
        return geo.kv_quant
    offsets = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               geo.stride_kh, geo.stride_vh, k_cache.data_ptr(), v_cache.data_ptr())  # fmt: skip
    if not all(x % 4 == 0 for x in offsets):
        return geo.kv_quant
    return E2M1_F16_NIB if FP4_NIBBLE_TILES else E2M1_F16


def decode_key(kv_layout, kv_quant: int) -> str | None:
    """The per-format key of a decode launch's defaults (``DECODE_PREFETCH``,
    ``kvplan.ops._paged_kv_tiles.DECODE_MAXNREG``): ``kv_layout.quantized_dtype`` (None for
    float caches), ``"e2m1_f16"`` for fp4 pages read as fp16 tiles (``kv_quant`` from
    `_kv_quant`)."""
    if kv_layout is None:
        return None
    f16 = kv_quant in (E2M1_F16, E2M1_F16_NIB)
    return "e2m1_f16" if f16 else kv_layout.quantized_dtype


def decode_keys(quantized_dtype: str | None) -> tuple[str | None, ...]:
    """Every `decode_key` a launch over pages of ``quantized_dtype`` (None: a float cache) can
    take: e2m1 pages also read as fp16 tiles (``"e2m1_f16"``).

    >>> decode_keys("e2m1"), decode_keys("e4m3"), decode_keys(None)
    (('e2m1', 'e2m1_f16'), ('e4m3',), (None,))
    """
    return (quantized_dtype, "e2m1_f16") if quantized_dtype == "e2m1" else (quantized_dtype,)


def _dot_precision(dtype) -> str:
    """fp32 caches get exact fp32 products (tf32 would miss the 1e-5 tolerance)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _group_tile(group_size: int) -> int:
    """Rows of a decode tile: the query-head group, padded to a power of two >= 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(group_size))


def launch_decode(
    q, k_cache, v_cache, page_ids, page_start, kv_lens, out, *, scale, window, num_splits,
    geo, kv_quant, kv_layout=None, tile_n=64, num_warps=4, num_stages=2, prefetch=None,
    maxnreg=None, heads_first=None, heads=1, ring=None,
):  # fmt: skip
    """Run ``_decode_kernel`` (and ``_combine_kernel`` when ``num_splits > 1``) into ``out``;
    ``ring``: a `kvplan.ops.paged_attention.RecentRing` or None;
    ``prefetch`` as in `_attend_range_ahead` (None: ``QUANT_PREFETCH``, then
    ``DECODE_PREFETCH``); ``maxnreg``: the compiler's register cap per thread (None: none);
    ``geo`` / ``kv_quant``: the caches' `kv_geometry` and `_kv_quant` (the caller's split plan
    reads them too); ``heads_first``: the program order (None: `DECODE_HEADS_FIRST`);
    ``heads``: KV heads a program (`decode_heads`' answer)."""
    batch, num_heads, head_dim = q.shape
    if heads_first is None:
        heads_first = DECODE_HEADS_FIRST
    group_size = num_heads // geo.num_kv_heads
    page_splits = num_splits
    if ring is not None:  # one more partial: the ring's (its own launch, RING 3)
        num_splits += 1
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused by the kernel
    if batch == 0:
        return out
    programs = geo.num_kv_heads // heads
    grid = (programs, batch) if heads_first else (batch, programs)
    launches = [(page_splits, 0)] if ring is None else [(page_splits, 2), (1, 3)]
    for splits, mode in launches:
        _decode_kernel[(*grid, splits)](
            q, k_cache, v_cache, page_ids, page_start, kv_lens, out, part_acc, part_m, part_l,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), geo.stride_kh,
            v_cache.stride(0), v_cache.stride(1), geo.stride_vh,
            out.stride(0), out.stride(1), group_size, window, scale * LOG2E, num_splits,
            geo.sf_off, *_ring_args(ring, q, kv_lens),
            TILE_M=_group_tile(group_size * heads), BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n,
            HEAD_DIM=head_dim,
            DOT_PRECISION=_dot_precision(q.dtype), INTERPRET=triton_interpreting(), SPLIT=split,
            KV_QUANT=kv_quant, SF_KIND=geo.sf_kind, GROUP=geo.group,
            PREFETCH=_prefetch(prefetch, kv_layout, decode=True,
                               key=decode_key(kv_layout, kv_quant)),
            HEADS_FIRST=bool(heads_first), HEADS=heads, RING=mode,
            num_warps=num_warps, num_stages=num_stages,
            **({} if maxnreg is None or triton_interpreting() else {"maxnreg": maxnreg}),
        )  # fmt: skip
    if split:
        _combine_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_heads, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            num_warps=4,
        )  # fmt: skip
    return out


def launch_prefill(
    q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, out, *, scale, window,
    max_q_len, kv_layout=None, tile_m=64, tile_n=64, num_warps=4, num_stages=2, prefetch=None,
    ring=None,
):  # fmt: skip
    """Run ``_prefill_kernel`` into ``out``; ``max_q_len`` bounds every sequence's query count;
    ``prefetch`` as in `launch_decode` (no per-format default: None is ``QUANT_PREFETCH`` or
    off); ``ring`` as in `launch_decode`."""
    batch = kv_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    geo = kv_geometry(k_cache, v_cache, head_dim, kv_layout)
    group_size = num_heads // geo.num_kv_heads
    num_row_tiles = triton.cdiv(max_q_len * group_size, tile_m)
    if batch == 0 or num_row_tiles == 0:
        return out
    _prefill_kernel[(batch, num_row_tiles, geo.num_kv_heads)](
        q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), geo.stride_kh,
        v_cache.stride(0), v_cache.stride(1), geo.stride_vh,
        out.stride(0), out.stride(1), group_size, window, scale * LOG2E,
        geo.sf_off, *_ring_args(ring, q, kv_lens),
        TILE_M=tile_m, BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(q.dtype), INTERPRET=triton_interpreting(),
        KV_QUANT=geo.kv_quant, SF_KIND=geo.sf_kind, GROUP=geo.group,
        PREFETCH=_prefetch(prefetch, kv_layout, decode=False), RING=ring is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _ring_args(ring, q, kv_lens) -> tuple:
    """The kernels' eight ring arguments (``ring_k_ptr`` .. ``stride_rh``; a ring ``window``
    of 0 passes ``NO_WINDOW``: one bound a sequence); without a ring, placeholders the
    kernels do not read."""
    if ring is None:
        return q, q, kv_lens, kv_lens, 1, NO_WINDOW, 0, 0
    return (ring.k, ring.v, ring.base, ring.lo, ring.size, ring.window or NO_WINDOW,
            ring.k.stride(0), ring.k.stride(1))  # fmt: skip
