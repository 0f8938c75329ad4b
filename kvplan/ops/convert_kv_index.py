"""Decode top-k indices: logical token index -> physical slot through the block table.

The indexer of a sparse layer picks, per query row, a list of logical (compressed) token
indices. The paged attention kernel reads physical slots, so each entry becomes::

    out[r, k] = block_tables[r, x // block_size] * block_size + x % block_size,  x = topk[r, k]

for list positions ``k < context_lens[r]`` holding ``x != -1``; every other entry is ``-1`` (the
kernel skips it). Example with ``block_size = 4``, ``block_tables[r] = [7, 2]``::

    topk[r] = [5, 0, -1, 6], context_lens[r] = 3  ->  [9, 28, -1, -1]

``block_size`` is the number of tokens of the indexed space one block holds: for a compressed
cache of ratio ``n`` that is ``cache_block_size // n``. The conversion is in place by default
(no allocation, CUDA-graph friendly). Reading of the seed: the bound compares the list
*position* with the context length (``context_lens`` = ``klen``, the number of visible
compressed tokens), so an indexer that returns fewer than ``k`` candidates may leave garbage
past them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import check_int32, check_same_device, check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.swa_index import index_out_buffer, index_tiles

__all__ = [
    "convert_kv_index",
    "convert_kv_index_ref",
    "convert_kv_index_torch",
    "convert_kv_index_triton",
]


@jit(sizes=("rows",))
def _convert_kv_index_kernel(
    topk_ptr, bt_ptr, ctx_ptr, out_ptr, rows, k, block_size, stride_t, stride_bt, stride_o,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    rmask = r < rows
    r64 = r.to(tl.int64)[:, None]
    col = c[None, :]
    mask = rmask[:, None] & (col < k)
    x = tl.load(topk_ptr + r64 * stride_t + col, mask=mask, other=-1)
    ctx = tl.load(ctx_ptr + r, mask=rmask, other=0)[:, None]
    valid = mask & (col < ctx) & (x != -1)
    blk = x // block_size
    phys = tl.load(bt_ptr + r64 * stride_bt + blk, mask=valid, other=0)
    val = tl.where(valid, phys * block_size + (x - blk * block_size), -1)
    tl.store(out_ptr + r64 * stride_o + col, val, mask=mask)


def _args(topk_idxs, block_tables, context_lens, block_size, out, check) -> torch.Tensor:
    check_tensor("topk_idxs", topk_idxs, dtype=torch.int32, ndim=2)
    if topk_idxs.shape[1] > 1 and topk_idxs.stride(1) != 1:
        raise ValueError(f"topk_idxs must have unit column stride, got {topk_idxs.stride()}")
    rows = topk_idxs.shape[0]
    check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2)
    if block_tables.shape[0] < rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, need >= {rows}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have unit column stride, got {block_tables.stride()}")
    check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(rows,), contiguous=True)
    check_same_device(topk_idxs=topk_idxs, block_tables=block_tables, context_lens=context_lens)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if check and topk_idxs.numel():
        _check_values(topk_idxs, block_tables[:rows], context_lens, block_size)
    if out is None:
        return topk_idxs
    return index_out_buffer(out, rows, topk_idxs.shape[1], topk_idxs.device)


def _check_values(topk_idxs, block_tables, context_lens, block_size) -> None:
    """Entries the kernel converts must address the table; the blocks read must be valid."""
    if int(context_lens.min()) < 0:
        raise ValueError(f"context_lens holds {int(context_lens.min())}; lengths must be >= 0")
    x = topk_idxs.to(torch.int64)
    col = torch.arange(x.shape[1], device=x.device)[None, :]
    used = (col < context_lens[:, None]) & (x != -1)
    limit = block_tables.shape[1] * block_size
    bad = used & ((x < 0) | (x >= limit))
    if bool(bad.any()):
        r, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"topk_idxs[{r}, {k}] = {int(x[r, k])} is outside [-1, {limit}) "
            f"(block_tables width {block_tables.shape[1]} x block_size {block_size})"
        )
    if bool(used.any()):
        blocks = torch.gather(block_tables.long(), 1, torch.where(used, x // block_size, 0))[used]
        if int(blocks.min()) < 0:
            raise ValueError(f"block_tables holds block id {int(blocks.min())} at a used entry")
        check_int32("block_tables max slot", int(blocks.max()) * block_size + block_size - 1)


def convert_kv_index_triton(
    topk_idxs: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton kernel for :func:`convert_kv_index`."""
    res = _args(topk_idxs, block_tables, context_lens, block_size, out, check)
    rows, k = topk_idxs.shape
    if rows == 0 or k == 0:
        return res
    tile_r, tile_c = index_tiles(rows, k)
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(k, tile_c))
    _convert_kv_index_kernel[grid](
        topk_idxs, block_tables, context_lens, res, rows, k, block_size,
        topk_idxs.stride(0), block_tables.stride(0), res.stride(0),
        TILE_R=tile_r, TILE_C=tile_c, num_warps=4,
    )  # fmt: skip
    return res


def convert_kv_index_torch(
    topk_idxs: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path of :func:`convert_kv_index`."""
    res = _args(topk_idxs, block_tables, context_lens, block_size, out, check)
    rows, k = topk_idxs.shape
    if rows == 0 or k == 0:
        return res
    x = topk_idxs.long()  # a copy, so writing res in place is safe
    col = torch.arange(k, device=x.device)[None, :]
    valid = (col < context_lens[:, None]) & (x != -1)
    table = torch.nn.functional.pad(block_tables[:rows].long(), (0, 1))  # [rows, M + 1]
    blk = torch.where(valid, x // block_size, 0).clamp(0, table.shape[1] - 1)
    phys = torch.gather(table, 1, blk)
    res.copy_(torch.where(valid, phys * block_size + x % block_size, -1))
    return res


def convert_kv_index_ref(
    topk_idxs: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:  # fmt: skip
    """Per-element reference (tests only); returns a new tensor."""
    tables = block_tables.tolist()
    out = topk_idxs.tolist()
    for r, (row, ctx) in enumerate(zip(out, context_lens.tolist(), strict=True)):
        for k, x in enumerate(row):
            ok = k < ctx and x != -1
            row[k] = tables[r][x // block_size] * block_size + x % block_size if ok else -1
    return torch.tensor(out, dtype=torch.int32).reshape(topk_idxs.shape)


def convert_kv_index(
    topk_idxs: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    block_size: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Convert top-k logical indices to physical slots (formula in the module docstring).

    Args:
        topk_idxs: int32 ``[rows, k]`` logical indices (``-1`` = none), unit column stride;
            converted in place unless ``out`` is given.
        block_tables: int32 ``[>= rows, max_num_blocks]`` per query row; only entries that a
            converted index addresses are read (the unused right part may hold anything).
        context_lens: int32 ``[rows]``, list positions ``>= context_lens[r]`` become ``-1``.
        block_size: tokens of the indexed space per block (``cache_block_size // ratio``).
        out: optional int32 ``[>= rows, k]`` buffer for the result instead of ``topk_idxs``.
        check: validate values (one host sync): converted indices inside
            ``[0, max_num_blocks * block_size)``, their blocks ``>= 0``, slots within int32.

    Returns:
        The converted ``[rows, k]`` tensor (``topk_idxs`` itself, or a view of ``out``).
    """
    fn = convert_kv_index_triton if use_triton(topk_idxs) else convert_kv_index_torch
    return fn(topk_idxs, block_tables, context_lens, block_size, out=out, check=check)
