"""The lightning indexer's scoring over key sources read in place (``index_scores``) and its
top-k (``topk_columns``, re-exported from ``kvplan.ops.topk``).

CUDA tensors run ``index_scores_tc_kernel`` of ``kvplan.ops._sparse_attention_kernels``
(bf16 queries on the tensor cores, fp32 queries in fp32); CPU tensors the torch gather.
"""

from __future__ import annotations

import torch
import triton

from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.sparse_sources import (
    MAX_HEAD_DIM,
    KeySource,
    SourceAddress,
    flat_scales,
    gather_rows,
    source_address,
)
from kvplan.ops.topk import topk_columns

__all__ = ["index_scores", "index_scores_triton", "topk_columns"]


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
    check_tensor("index_q", index_q, dtype=(torch.float32, torch.bfloat16), ndim=3)
    num_rows, num_heads, width = index_q.shape
    check_tensor("index_weights", index_weights, shape=(num_rows, num_heads))
    if not 1 <= num_heads <= 128 or width > MAX_HEAD_DIM:
        raise ValueError(f"index_q: need 1 <= Hi <= 128 and Ci <= 512, got {(num_heads, width)}")
    idx = check_tensor("keys.index", keys.index, dtype=torch.int32, ndim=2)
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
    num_warps: int | None = None, legacy: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The Triton path of :func:`index_scores` (inputs checked there; ``addr`` its
    addressing of ``keys``). ``index_scores_tc_kernel``: ``tile_n`` keys per dot, ``tiles``
    key tiles per program; bf16 queries use the tensor cores (bf16 x bf16-exact keys, fp32
    accumulation: exact products; fp32 rows are not bf16-exact and keep fp32), fp32 queries
    fp32 ``"ieee"`` products. ``legacy``: the
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
    tile_n = tile_n or (128 if d_p2 <= 128 else 64)
    grid = (num_rows, triton.cdiv(idx.shape[1], tile_n * tiles))
    _k.index_scores_tc_kernel[grid](
        *args, TILE_N=tile_n, TILES=tiles, **consts,
        DOT_BF16=index_q.dtype == torch.bfloat16 and addr.kind != _k.KIND_FP32 and not interpret,
        num_warps=num_warps or 4,
    )  # fmt: skip
    return out
