"""Greedy sampling's row argmax over a step's logits, read in the model's dtype.

`argmax_rows(x)` is ``x.argmax(dim=-1)`` of a ``[N, V]`` float tensor, with torch's rules: the
first index of the largest value, NaN larger than every number (the first NaN wins), ``-0.0``
equal to ``+0.0``. On CUDA two Triton kernels replace torch's one-program-per-row reduction:

1. ``_argmax_part_kernel``, grid ``(N, S)``: program ``(r, s)`` scans columns ``[s * chunk,
   (s + 1) * chunk)`` of row ``r`` in tiles, each lane keeping the best key it has seen (ints
   that order as the floats do, NaN the largest) and its first column; the program writes its
   best ``(key, column)``;
2. ``_argmax_merge_kernel``, grid ``(N,)`` (`argmax_merge`): the best key of the row's S
   parts, and the first column that holds it (parts cover increasing columns).

The LM head's GEMM (`kvplan.ops.small_gemm.small_linear` with ``argmax_out``) writes the same
per-part ``(key, column)`` pairs from its output tiles, one part per tile of vocabulary rows,
and `argmax_merge` finishes them: the logits are then never read again.

S is chosen so that about four programs run per SM (a decode step has few rows and a wide
vocabulary: torch's kernel gives each row one block). Reading bf16 logits directly lets the
model skip its fp32 copy of the whole ``[N, V]`` output when only the argmax is wanted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import cuda_sm_count, triton_interpreting, use_triton
from kvplan.ops._launch import jit
from kvplan.ops.topk import _sort_keys

__all__ = [
    "argmax_merge",
    "argmax_rows",
    "argmax_rows_torch",
    "argmax_rows_triton",
    "argmax_splits",
    "check_argmax_out",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
TILE = 2048  # columns a program loads per iteration (8 a thread at 8 warps: 16-byte loads)
# split target of `argmax_splits`: `bench_argmax.py --sweep` (H200, 2026-12-02, bf16, graph
# replay) 64 x 128,256: 2 / 8 / 16 parts 14.5 / 10.5 / 10.7 us (the default of 2 an SM, 5
# parts: 12.0; torch's argmax of the fp32 copy, copy included: 61.8); 32 x 129,280: 8 / 16
# parts 7.5 / 7.1 us (copy + torch 37.1)
PROGRAMS_PER_SM = 4
MERGE_TILE = 1024  # parts `_argmax_merge_kernel` loads at once (more: it loops over chunks)
_INT32_MIN = tl.constexpr(-(2**31))  # the key of a masked column (no float has it)
_INT32_MAX = tl.constexpr(2**31 - 1)  # the key of every NaN


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Int64 ``[N]``: the column of each row's largest value in ``x [N, V]`` (float; columns
    contiguous). Equal to ``x.argmax(dim=-1)`` (ties: the first; NaN counts as largest).

    ``out``: int64 ``[N]``, contiguous, on ``x``'s device (`check_argmax_out`), written and
    returned instead of a new tensor (a CUDA graph's static buffer).
    """
    if use_triton(x):
        return argmax_rows_triton(x, out=out)
    got = argmax_rows_torch(x)
    if out is None:
        return got
    check_argmax_out(out, x.shape[0], x.device, "out")
    return out.copy_(got)


def argmax_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch path of `argmax_rows` (the reference)."""
    _check(x)
    return x.argmax(dim=-1)


def check_argmax_out(
    out: object, rows: int, device: torch.device, name: str = "argmax_out"
) -> None:
    """``out`` must be an int64 ``[rows]`` contiguous tensor on ``device``: else a
    TypeError / ValueError naming ``name`` and what it got."""
    check_tensor(name, out, dtype=torch.int64, shape=(rows,), device=device, contiguous=True)


def _check(x: torch.Tensor) -> None:
    check_tensor("x", x, dtype=_FLOATS, ndim=2)
    if x.shape[1] == 0:
        raise ValueError(f"x: a row needs at least one column, got shape {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride on its columns, got strides {x.stride()}")


def argmax_splits(num_rows: int, width: int, tile: int, num_sms: int) -> int:
    """Parts per row: about ``PROGRAMS_PER_SM`` programs an SM, at most one a tile."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_rows, 1))
    return max(1, min(triton.cdiv(width, tile), want))


def argmax_rows_triton(
    x: torch.Tensor, *, splits: int | None = None, tile: int | None = None,
    num_warps: int = 8, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton path of `argmax_rows` (also on CPU under ``TRITON_INTERPRET=1``); ``splits``
    parts per row (None: `argmax_splits` on CUDA, 2 in the interpreter), ``tile`` columns an
    iteration; ``out`` as in `argmax_rows`."""
    _check(x)
    num_rows, width = x.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    else:
        check_argmax_out(out, num_rows, x.device, "out")
    if num_rows == 0:
        return out
    interp = triton_interpreting()
    tile = tile or (64 if interp else TILE)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if splits is None:
        splits = 2 if interp or not x.is_cuda else argmax_splits(
            num_rows, width, tile, cuda_sm_count(x.device)
        )  # fmt: skip
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    chunk = triton.cdiv(triton.cdiv(width, splits), tile) * tile
    splits = triton.cdiv(width, chunk)
    keys, cols = torch.empty(2, num_rows, splits, dtype=torch.int32, device=x.device)
    _argmax_part_kernel[(num_rows, splits)](
        x,
        keys,
        cols,
        x.stride(0),
        width,
        chunk,
        splits,
        TILE=tile,
        INTERPRET=interp,
        num_warps=num_warps,
    )
    return argmax_merge(keys, cols, out)


def argmax_merge(
    keys: torch.Tensor, cols: torch.Tensor, out: torch.Tensor, *, tile: int = MERGE_TILE
) -> torch.Tensor:
    """Finish a split argmax: ``out[r]`` = the column of row ``r``'s best part, ``out``
    returned.

    Args:
        keys: int32 ``[N, S]``, contiguous: part ``s`` of row ``r``'s best order key (`_order_keys`:
            ints that order as the floats do, every NaN ``2^31 - 1``, ``-2^31`` for a part
            without columns).
        cols: int32 ``[N, S]``, contiguous: the first column of that part holding that key.
            Parts cover increasing columns (part ``s``'s columns all precede part ``s + 1``'s).
        out: int64 ``[N]``, contiguous, same device: written.
        tile: parts a program loads at once (a power of two >= 16); wider rows loop.

    The first column of the row's largest key wins: ties go to the earlier part, then to
    the lower column.
    """
    check_tensor("keys", keys, dtype=torch.int32, ndim=2, contiguous=True)
    num_rows, splits = keys.shape
    check_tensor("cols", cols, dtype=torch.int32, shape=(num_rows, splits), device=keys.device,
                 contiguous=True)  # fmt: skip
    check_argmax_out(out, num_rows, keys.device, "out")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if splits < 1:
        raise ValueError(f"keys must hold at least one part a row, got shape {tuple(keys.shape)}")
    if num_rows == 0:
        return out
    s_p2 = max(16, min(tile, triton.next_power_of_2(splits)))
    chunks = triton.cdiv(splits, s_p2)
    # 1,002 parts (the LM head's tiles of 128,256 words): 4 warps, 8 parts a thread
    num_warps = 1 if s_p2 <= 128 else 4
    _argmax_merge_kernel[(num_rows,)](
        keys, cols, out, splits, S_P2=s_p2, CHUNKS=chunks, num_warps=num_warps
    )
    return out


@jit
def _order_keys(x):
    """`topk`'s sort keys of ``x`` widened to fp32 (``-0.0`` as ``+0.0``), every NaN above
    ``+inf``."""
    x = x.to(tl.float32)
    return tl.where(x != x, _INT32_MAX, _sort_keys(x))


@jit
def _scan_tile(x_row, lo, start, offs, width, chunk, best, where):
    """Fold columns ``lo + start + offs`` (those inside the row and the part) into each
    lane's best key and its column."""
    c = lo + start + offs
    ok = (c < width) & (start + offs < chunk)
    key = tl.where(ok, _order_keys(tl.load(x_row + c, mask=ok, other=0.0)), _INT32_MIN)
    take = key > best  # strictly: a lane keeps the first column of its best key
    return tl.where(take, key, best), tl.where(take, c, where)


@jit
def _argmax_part_kernel(
    x_ptr, key_ptr, col_ptr, stride_x, width, chunk, splits,
    TILE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * chunk
    offs = tl.arange(0, TILE)
    best = tl.full([TILE], _INT32_MIN, tl.int32)
    where = tl.zeros([TILE], tl.int32)
    x_row = x_ptr + row * stride_x
    if INTERPRET:  # the interpreter's range() cannot take a runtime bound (numpy >= 2)
        start = 0
        while start < chunk:
            best, where = _scan_tile(x_row, lo, start, offs, width, chunk, best, where)
            start += TILE
    else:
        for start in range(0, chunk, TILE):
            best, where = _scan_tile(x_row, lo, start, offs, width, chunk, best, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, _INT32_MAX), axis=0)
    tl.store(key_ptr + row * splits + part, top)
    tl.store(col_ptr + row * splits + part, first)


@jit
def _argmax_merge_kernel(
    key_ptr, col_ptr, out_ptr, splits, S_P2: tl.constexpr, CHUNKS: tl.constexpr
):
    """Row ``r``'s best of its ``splits`` parts, ``S_P2`` at a time over ``CHUNKS`` chunks:
    each lane keeps the first (lowest part) of its best key, then the lowest column of the
    row's best key over the lanes."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_P2)
    best = tl.full([S_P2], _INT32_MIN, tl.int32)
    where = tl.full([S_P2], _INT32_MAX, tl.int32)
    for c in range(CHUNKS):  # a static trip count (one chunk up to S_P2 parts)
        part = c * S_P2 + s
        ok = part < splits
        key = tl.load(key_ptr + row * splits + part, mask=ok, other=_INT32_MIN)
        col = tl.load(col_ptr + row * splits + part, mask=ok, other=_INT32_MAX)
        take = ok & (key > best)  # strictly: an earlier part keeps a tied key
        best = tl.where(take, key, best)
        where = tl.where(take, col, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, _INT32_MAX), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))
