"""Triton kernels for paged attention that read the page table directly.

Both kernels address the KV cache through a flat page table: the j-th page of sequence ``b``
is ``page_ids[page_start[b] + j]`` and key position ``p`` of that sequence lives in cache
block ``page_ids[page_start[b] + p // block_size]`` at row ``p % block_size``. The same kernel
therefore serves the ragged page table (``page_start = paged_kv_indptr[:-1]``) and the block
offsets table (``page_start = b * row_stride``).

GQA grouping: a program owns one KV head and packs the query heads that share it into the
rows of its tile, so each K/V tile is loaded once for the whole group::

    row r of a tile  ->  query token i = r // group_size, query head kvh * group_size + r % group_size

Softmax is computed online in the log2 domain (``qk_scale = scale * log2(e)``); running maxima
start at -1e30 rather than -inf so that rows which see no key stay finite and end with
``l == 0``, which the epilogues turn into an all-zero output row.

Kernels:
- ``_decode_kernel``: grid ``(B, Hkv, num_splits)``; one query per sequence; the visible key
  range is cut into ``num_splits`` chunks (split-K). With one split it writes the output, else
  fp32 partials that ``_combine_kernel`` (grid ``(B, H)``) merges.
- ``_prefill_kernel``: grid ``(B, num_row_tiles, Hkv)``; varlen causal, tiles over query rows
  and keys; also serves decode rows with several query tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan.ops._dispatch import triton_interpreting

# Stand-in for "no sliding window": far beyond any int32 position difference we produce.
NO_WINDOW = 1 << 30


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    start,
    q,
    row_pos,
    key_hi,
    page_ptr,
    k_ptr,
    v_ptr,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    block_size,
    window,
    qk_scale,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [start, start + TILE_N) (clipped at key_hi)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = start + tl.arange(0, TILE_N)
    in_range = offs_n < key_hi
    # One page-table lookup per key: tiles may straddle pages of any block_size.
    page = tl.load(page_ptr + offs_n // block_size, mask=in_range, other=0).to(tl.int64)
    row = (offs_n % block_size).to(tl.int64)
    k_rows = page * stride_kb + row * stride_kt  # [TILE_N]
    k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [TILE_M, TILE_N]
    visible = (
        in_range[None, :]
        & (offs_n[None, :] <= row_pos[:, None])
        & (offs_n[None, :] > row_pos[:, None] - window)
    )
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_rows = page * stride_vb + row * stride_vt
    v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_rows(
    q,  # [TILE_M, HEAD_DIM] queries in the cache dtype
    row_pos,  # [TILE_M] int32 absolute query positions (-1 = padding row, sees nothing)
    key_lo,  # first key position to visit
    key_hi,  # one past the last key position to visit
    page_ptr,  # page_ids + page_start[b]
    k_ptr,  # k_cache + kv_head * stride_kh
    v_ptr,  # v_cache + kv_head * stride_vh
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    block_size,
    window,
    qk_scale,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online-softmax attention of ``TILE_M`` query rows over keys [key_lo, key_hi).

    Returns the unnormalized accumulator [TILE_M, HEAD_DIM] (fp32), the running maximum m
    (log2 domain) and the running denominator l, both [TILE_M] fp32. The CPU interpreter
    (numpy >= 2.4) cannot take a runtime tensor as a ``range`` bound, so there the same tile
    step runs in a ``while`` loop; compiled kernels use the pipelined ``for`` loop.
    """
    m_i = tl.full([TILE_M], -1.0e30, tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    if INTERPRET:
        start = key_lo
        while start < key_hi:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, start, q, row_pos, key_hi, page_ptr, k_ptr, v_ptr,
                stride_kb, stride_kt, stride_vb, stride_vt, block_size, window, qk_scale,
                TILE_N, HEAD_DIM, DOT_PRECISION,
            )  # fmt: skip
            start += TILE_N
    else:
        for start in range(key_lo, key_hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, start, q, row_pos, key_hi, page_ptr, k_ptr, v_ptr,
                stride_kb, stride_kt, stride_vb, stride_vt, block_size, window, qk_scale,
                TILE_N, HEAD_DIM, DOT_PRECISION,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D] (strided)
    v_ptr,
    page_ids_ptr,  # int32 flat page table
    page_start_ptr,  # int32 [B]
    kv_lens_ptr,  # int32 [B]
    out_ptr,  # [B, H, D] (used when SPLIT is False)
    part_acc_ptr,  # fp32 [B, H, num_splits, D] (used when SPLIT is True)
    part_m_ptr,  # fp32 [B, H, num_splits]
    part_l_ptr,  # fp32 [B, H, num_splits]
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_oh,
    group_size,
    block_size,
    window,
    qk_scale,
    num_splits,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    page_start = tl.load(page_start_ptr + b)
    # The query sits at position kv_len - 1 and sees keys kv_len - window .. kv_len - 1.
    lo = tl.maximum(kv_len - window, 0)
    per_split = (kv_len - lo + num_splits - 1) // num_splits
    chunk = (per_split + TILE_N - 1) // TILE_N * TILE_N
    key_lo = lo + split * chunk
    key_hi = tl.minimum(key_lo + chunk, kv_len)

    offs_g = tl.arange(0, TILE_M)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < group_size
    heads = (kvh * group_size + offs_g).to(tl.int64)
    q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0.0)
    row_pos = tl.where(g_ok, kv_len - 1, -1)
    acc, m_i, l_i = _attend_rows(
        q,
        row_pos,
        key_lo,
        key_hi,
        page_ids_ptr + page_start,
        k_ptr + kvh * stride_kh,
        v_ptr + kvh * stride_vh,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        block_size,
        window,
        qk_scale,
        TILE_M,
        TILE_N,
        HEAD_DIM,
        DOT_PRECISION,
        INTERPRET,
    )
    if SPLIT:
        # Partials: [B, H, S, D] and [B, H, S]; row index (b * H + head) * S + split.
        H = tl.num_programs(1) * group_size
        part_row = (b.to(tl.int64) * H + heads) * num_splits + split  # [TILE_M]
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None]
        )
        tl.store(part_m_ptr + part_row, m_i, mask=g_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=g_ok)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _combine_kernel(
    part_acc_ptr,  # fp32 [B, H, S, D]
    part_m_ptr,  # fp32 [B, H, S]
    part_l_ptr,  # fp32 [B, H, S]
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    w = tl.exp2(m - tl.max(m, 0))  # [SPLITS_PAD]; padding splits get weight 0
    den = tl.sum(w * lsum, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    o_off = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,
    v_ptr,
    page_ids_ptr,
    page_start_ptr,  # int32 [B]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    kv_lens_ptr,  # int32 [B]
    out_ptr,  # [T, H, D]
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    group_size,
    block_size,
    window,
    qk_scale,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
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
    acc, m_i, l_i = _attend_rows(
        q,
        row_pos,
        key_lo,
        key_hi,
        page_ids_ptr + page_start,
        k_ptr + kvh * stride_kh,
        v_ptr + kvh * stride_vh,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        block_size,
        window,
        qk_scale,
        TILE_M,
        TILE_N,
        HEAD_DIM,
        DOT_PRECISION,
        INTERPRET,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = t64[:, None] * stride_ot + h64[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Launchers (inputs are validated by kvplan.ops.paged_attention before they get here).
# ---------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def _dot_precision(dtype) -> str:
    """fp32 caches get exact fp32 products (tf32 would miss the 1e-5 tolerance)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _group_tile(group_size: int) -> int:
    """Rows of a decode tile: the query-head group, padded to a power of two >= 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(group_size))


def launch_decode(
    q, k_cache, v_cache, page_ids, page_start, kv_lens, out, *, scale, window, num_splits,
    tile_n=64, num_warps=4, num_stages=2,
):  # fmt: skip
    """Run ``_decode_kernel`` (and ``_combine_kernel`` when ``num_splits > 1``) into ``out``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
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
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_ids, page_start, kv_lens, out, part_acc, part_m, part_l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        group_size, k_cache.shape[1], window, scale * LOG2E, num_splits,
        TILE_M=_group_tile(group_size), TILE_N=tile_n, HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(q.dtype), INTERPRET=triton_interpreting(), SPLIT=split,
        num_warps=num_warps, num_stages=num_stages,
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
    max_q_len, tile_m=64, tile_n=64, num_warps=4, num_stages=2,
):  # fmt: skip
    """Run ``_prefill_kernel`` into ``out``; ``max_q_len`` bounds every sequence's query count."""
    batch = kv_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    num_row_tiles = triton.cdiv(max_q_len * group_size, tile_m)
    if batch == 0 or num_row_tiles == 0:
        return out
    _prefill_kernel[(batch, num_row_tiles, num_kv_heads)](
        q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        group_size, k_cache.shape[1], window, scale * LOG2E,
        TILE_M=tile_m, TILE_N=tile_n, HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(q.dtype), INTERPRET=triton_interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
