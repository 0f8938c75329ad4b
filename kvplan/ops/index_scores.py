"""The lightning indexer's scoring over key sources read in place (``index_scores``) and its
top-k (``topk_columns``, re-exported from ``kvplan.ops.topk``).

CUDA tensors run ``index_scores_tc_kernel`` of ``kvplan.ops._sparse_attention_kernels``
(bf16 queries on the tensor cores, fp32 queries in fp32); CPU tensors the torch gather.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops._dispatch import env_count, triton_interpreting, use_triton
from kvplan.ops.sparse_sources import (
    MAX_HEAD_DIM,
    KeySource,
    SourceAddress,
    flat_scales,
    gather_rows,
    source_address,
)
from kvplan.ops.topk import topk_columns

__all__ = ["index_scores", "index_scores_by_sequence", "index_scores_triton", "topk_columns"]

# keys per program of index_scores_tc_kernel for keys up to 128 wide (``KVPLAN_INDEX_TILE_N``,
# a power of two >= 16): 64 keys take 76 registers a thread (6 programs an SM) against 135 at
# 128 (3), so more key gathers are in flight. H100, 2026-12-07: alone (`bench_sparse_kernels.py
# --only index --rows 32 --candidates 8192 --index-kinds mxfp8 --sweep`, graph replay medians)
# 18.6 us against 20.2 for 128 keys; in the profiled 32K x 32 fp8 decode step
# (`bench/run_s54e.sh`, alternating) 107.6 / 108.0 us a step (5 launches) against 120.3 /
# 120.9 with 128.
TC_TILE_N = env_count("KVPLAN_INDEX_TILE_N", 64)
if TC_TILE_N < 16 or TC_TILE_N & (TC_TILE_N - 1):
    raise ValueError(f"KVPLAN_INDEX_TILE_N must be a power of two >= 16, got {TC_TILE_N}")
SEQ_ROWS = 4  # rows per program of index_scores_seq_kernel (times the heads: the dot's width)
SEQ_TILE_N = 64  # candidates per program of index_scores_seq_kernel


def _check_queries(index_q, index_weights, keys: KeySource):
    """``(T, Hi, Ci, keys.index)`` after checking the queries, weights and index dtype."""
    check_tensor("index_q", index_q, dtype=(torch.float32, torch.bfloat16), ndim=3)
    num_rows, num_heads, width = index_q.shape
    check_tensor("index_weights", index_weights, shape=(num_rows, num_heads))
    if not 1 <= num_heads <= 128 or width > MAX_HEAD_DIM:
        raise ValueError(f"index_q: need 1 <= Hi <= 128 and Ci <= 512, got {(num_heads, width)}")
    idx = check_tensor("keys.index", keys.index, dtype=torch.int32, ndim=2)
    return num_rows, num_heads, width, idx


def index_scores(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: KeySource,
    *,
    check: bool = True,
) -> torch.Tensor:
    """The lightning indexer's scores of every candidate, reading the index keys in place.

    Args:
        index_q: ``[T, Hi, Ci]`` fp32 / bf16 indexer queries (unit stride on Ci), ``Hi <= 128``.
        index_weights: ``[T, Hi]`` per-head weights (all scalings folded in).
        keys: a :class:`KeySource` over the index keys: plain rows, or a quantized paged
            cache in a split index layout (``MXFP8_INDEX_KV_FORMAT``,
            ``FP8_FLOAT32_SF_INDEX_KV_FORMAT``, ``FP4_INDEX_KV_FORMAT`` or the same layouts at
            other widths) or a token-interleaved one; ``keys.index`` int32 ``[T, K]`` slots.
        check: validate slot values (one device sync on CUDA).

    Returns fp32 ``[T, K]``: ``sum_h index_weights[t, h] * relu(index_q[t, h] . key)``
    (fp32 products), ``-inf`` where the slot is ``-1``.
    """
    num_rows, num_heads, width, idx = _check_queries(index_q, index_weights, keys)
    if idx.shape[0] != num_rows:
        raise ValueError(f"keys.index has {idx.shape[0]} rows, index_q has {num_rows}")
    check_same_device(index_q=index_q, index_weights=index_weights, cache=keys.cache, index=idx)
    addr = source_address(0, keys, width, split_ok=True)
    if check:
        check_range("keys.index", idx, -1, addr.num_slots)
    if not use_triton(index_q):
        rows = gather_rows(keys, idx)  # [T, K, Ci]
        dots = torch.einsum("thc,tkc->thk", index_q.float(), rows).relu()
        scores = torch.einsum("thk,th->tk", dots, index_weights.float())
        return scores.masked_fill(idx < 0, float("-inf"))
    return index_scores_triton(index_q, index_weights, keys, addr)


def index_scores_triton(
    index_q: torch.Tensor, index_weights: torch.Tensor, keys: KeySource,
    addr: SourceAddress | None = None, *, tile_n: int | None = None, tiles: int = 1,
    num_warps: int | None = None, legacy: bool = False, num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton path of :func:`index_scores` (inputs checked there; ``addr`` its
    addressing of ``keys``). ``index_scores_tc_kernel``: ``tile_n`` keys per dot, ``tiles``
    key tiles per program; bf16 queries use the tensor cores (bf16 x bf16-exact keys, fp32
    accumulation: exact products; fp32 rows are not bf16-exact and keep fp32), fp32 queries
    fp32 ``"ieee"`` products; ``num_stages``: Triton's software pipelining of the key tiles
    (its default when None). ``legacy``: the
    per-tile CUDA-core kernel ``index_scores_kernel`` (fp32 products for every query)."""
    idx = keys.index
    addr = addr or source_address(0, keys, index_q.shape[2], split_ok=True)
    num_rows, num_heads, width = index_q.shape
    out = torch.empty(idx.shape, dtype=torch.float32, device=idx.device)
    if idx.numel() == 0:
        return out
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    w = index_weights.float().contiguous()
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    d_p2 = max(16, triton.next_power_of_2(width))
    interpret = triton_interpreting()
    args = (
        q, w, out, addr.ptr, idx, q.stride(0), q.stride(1), w.stride(0), out.stride(0),
        idx.stride(0), num_heads, idx.shape[1], addr.num_slots, addr.block_size,
        addr.stride_block, addr.stride_token, addr.scale_stride, addr.scale_offset,
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=width, D_P2=d_p2, TILE_H=max(16, triton.next_power_of_2(num_heads)),
        KIND=addr.kind, SF=addr.sf, GS=addr.group, FLAT=flat_scales(addr, width, d_p2),
        HW=not interpret,
    )  # fmt: skip
    if legacy:
        tile_n = tile_n or (32 if d_p2 <= 128 else 16)
        grid = (num_rows, triton.cdiv(idx.shape[1], tile_n))
        _k.index_scores_kernel[grid](*args, TILE_N=tile_n, **consts, num_warps=num_warps or 4)
        return out
    tile_n = tile_n or (TC_TILE_N if d_p2 <= 128 else 64)
    grid = (num_rows, triton.cdiv(idx.shape[1], tile_n * tiles))
    _k.index_scores_tc_kernel[grid](
        *args, TILE_N=tile_n, TILES=tiles, **consts,
        DOT_BF16=index_q.dtype == torch.bfloat16 and addr.kind != _k.KIND_FP32,
        num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}),
    )  # fmt: skip
    return out


def index_scores_by_sequence(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: KeySource,
    cu_rows: np.ndarray,
    lens: torch.Tensor,
    *,
    check: bool = True,
    rows_per_program: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """:func:`index_scores` of rows grouped in sequences that share their candidates (the
    rows of one prompt chunk): a key is loaded and dequantized once for ``rows_per_program``
    rows instead of once per row.

    Args:
        index_q, index_weights: as in :func:`index_scores` (``T`` rows).
        keys: the index keys; ``keys.index`` int32 ``[S, K]``: sequence ``s``'s candidate
            slots (``-1``: none).
        cu_rows: host int ``[S + 1]``: sequence ``s`` owns rows ``cu_rows[s] .. cu_rows[s + 1]
            - 1`` (non-decreasing, from 0 to ``T``).
        lens: int32 ``[T]`` on the device: row ``r`` sees the columns below ``lens[r]`` (its
            candidates are a prefix of its sequence's), ``0 <= lens[r] <= K``.
        check: validate slots and lengths (a device sync on CUDA).

    Returns fp32 ``[T, K]``, equal to :func:`index_scores` over the per-row table (row ``r``:
    its sequence's slots, ``-1`` from column ``lens[r]`` on): the same products, summed over
    the heads in the same order up to the tensor cores' tiling.
    """
    num_rows, num_heads, width, idx = _check_queries(index_q, index_weights, keys)
    cu = np.asarray(cu_rows, dtype=np.int64)
    if cu.ndim != 1 or cu.shape[0] != idx.shape[0] + 1:
        raise ValueError(
            f"cu_rows must have {idx.shape[0] + 1} entries (keys.index rows + 1), got "
            f"shape {cu.shape}"
        )
    if cu[0] != 0 or cu[-1] != num_rows or (np.diff(cu) < 0).any():
        raise ValueError(
            f"cu_rows must rise from 0 to {num_rows} (index_q rows), got {cu.tolist()}"
        )
    check_tensor("lens", lens, dtype=torch.int32, shape=(num_rows,))
    check_same_device(index_q=index_q, index_weights=index_weights, cache=keys.cache, index=idx,
                      lens=lens)  # fmt: skip
    addr = source_address(0, keys, width, split_ok=True)
    if check:
        check_range("keys.index", idx, -1, addr.num_slots)
        check_range("lens", lens, 0, idx.shape[1] + 1)
    if not use_triton(index_q):  # the per-row table through index_scores
        row_seq = torch.from_numpy(np.repeat(np.arange(idx.shape[0]), np.diff(cu)))
        col = torch.arange(idx.shape[1], device=idx.device)[None, :]
        rows = torch.where(col < lens.long()[:, None], idx[row_seq.to(idx.device)], -1)
        return index_scores(index_q, index_weights, KeySource(keys.cache, rows.to(torch.int32),
                                                              keys.layout), check=False)  # fmt: skip
    from kvplan.backends.staging.arena import to_device

    rows_per = rows_per_program or SEQ_ROWS
    tile_n = tile_n or SEQ_TILE_N
    out = torch.empty((num_rows, idx.shape[1]), dtype=torch.float32, device=idx.device)
    if out.numel() == 0:
        return out
    seq_len = np.diff(cu)
    nblocks = -(-seq_len // rows_per)
    block_seq = np.repeat(np.arange(idx.shape[0]), nblocks)
    first = np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
    block_row = cu[block_seq] + (np.arange(block_seq.shape[0]) - first) * rows_per
    block_end = np.minimum(block_row + rows_per, cu[block_seq + 1])
    dev = idx.device
    blocks = [to_device(a, dev) for a in (block_row, block_end, block_seq)]  # int32
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    w = index_weights.float().contiguous()
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    d_p2 = max(16, triton.next_power_of_2(width))
    interpret = triton_interpreting()
    grid = (block_seq.shape[0], triton.cdiv(idx.shape[1], tile_n))
    _k.index_scores_seq_kernel[grid](
        q, w, out, addr.ptr, idx, lens, *blocks, q.stride(0), q.stride(1), w.stride(0),
        out.stride(0), idx.stride(0), num_heads, idx.shape[1], addr.num_slots,
        addr.block_size, addr.stride_block, addr.stride_token, addr.scale_stride,
        addr.scale_offset,
        HEAD_DIM=width, D_P2=d_p2, TILE_H=max(16, triton.next_power_of_2(num_heads)),
        TILE_N=tile_n, ROWS=rows_per, KIND=addr.kind, SF=addr.sf, GS=addr.group,
        FLAT=flat_scales(addr, width, d_p2), HW=not interpret,
        DOT_BF16=index_q.dtype == torch.bfloat16 and addr.kind != _k.KIND_FP32,
        num_warps=num_warps or 4,
    )  # fmt: skip
    return out
