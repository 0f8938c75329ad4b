"""Compressed-KV index expansion: ``kv_ca_index_offset_len`` -> dense ``kv_ca_index``.

Each query row gets ``(offset, length)``; the output width is ``kv_ca_index_width(max_len)``,
``max_len`` rounded up to a multiple of 128 (the sparse attention kernels read indices in
tiles of 128). Columns from ``length`` on are ``-1``.

* prefill (``expand_kv_ca_index``): rows of the contiguous, loaded compressed buffer::

      out[r, c] = offset[r] + c

* decode (``expand_kv_ca_index_decode``): physical slots of the paged compressed cache. With
  ``tpb = block_size // ratio`` compressed tokens per block and ``pos = offset[r] + c``::

      out[r, c] = block_tables[r, pos // tpb] * tpb + pos % tpb

  e.g. tpb = 4, block_tables[r] = [7, 2], offset = 2, length = 4  ->  [30, 31, 8, 9, -1, ...]

  ``block_tables`` is either per row, int32 ``[rows, max_num_blocks]`` (``offset`` is then the
  first compressed position of the row, usually 0), or one flat int32 ``[n]`` table shared by
  all rows (rows' tables laid end to end; ``offset[r] = r * max_num_blocks * tpb``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import INT32_MAX, check_int32, check_same_device, check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.swa_index import index_out_buffer, index_tiles

__all__ = [
    "expand_kv_ca_index",
    "expand_kv_ca_index_decode",
    "expand_kv_ca_index_decode_ref",
    "expand_kv_ca_index_decode_torch",
    "expand_kv_ca_index_decode_triton",
    "expand_kv_ca_index_ref",
    "expand_kv_ca_index_torch",
    "expand_kv_ca_index_triton",
    "kv_ca_index_width",
]

INDEX_WIDTH_ALIGN = 128


def kv_ca_index_width(max_len: int) -> int:
    """Output width for rows of at most ``max_len`` entries: ``max_len`` rounded up to 128."""
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be an int >= 0, got {max_len!r}")
    return max(1, -(-max_len // INDEX_WIDTH_ALIGN)) * INDEX_WIDTH_ALIGN


@jit(sizes=("rows",))
def _expand_kv_ca_kernel(
    ol_ptr, bt_ptr, out_ptr, rows, width, tpb, stride_ol, stride_bt, stride_o,
    PAGED: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    rmask = r < rows
    row = ol_ptr + r.to(tl.int64) * stride_ol
    offset = tl.load(row + 0, mask=rmask, other=0)[:, None]
    length = tl.load(row + 1, mask=rmask, other=0)[:, None]
    col = c[None, :]
    visible = col < length
    pos = offset + col
    if PAGED:
        blk = pos // tpb
        table = bt_ptr + r.to(tl.int64)[:, None] * stride_bt
        phys = tl.load(table + blk, mask=visible & rmask[:, None], other=0)
        pos = phys * tpb + (pos - blk * tpb)
    val = tl.where(visible, pos, -1)
    dst = out_ptr + r.to(tl.int64)[:, None] * stride_o + col
    tl.store(dst, val, mask=rmask[:, None] & (col < width))


def _check_offset_len(offset_len: torch.Tensor, max_len: int, check: bool) -> None:
    check_tensor("offset_len", offset_len, dtype=torch.int32, shape=(None, 2))
    if not check or offset_len.numel() == 0:
        return
    offset, length = offset_len.to(torch.int64).unbind(1)
    bad = (offset < 0) | (length < 0) | (length > max_len) | (offset + length - 1 > INT32_MAX)
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ValueError(
            f"offset_len[{r}] = {offset_len[r].tolist()}: needs offset >= 0, "
            f"0 <= length <= max_len={max_len} and offset + length - 1 within int32"
        )


def _launch(offset_len, block_tables, tpb, res, paged: bool) -> torch.Tensor:
    rows, width = res.shape
    if rows == 0:
        return res
    tile_r, tile_c = index_tiles(rows, width)
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(width, tile_c))
    bt = block_tables if paged else offset_len
    stride_bt = block_tables.stride(0) if paged and block_tables.dim() == 2 else 0
    _expand_kv_ca_kernel[grid](
        offset_len, bt, res, rows, width, tpb, offset_len.stride(0), stride_bt, res.stride(0),
        PAGED=paged, TILE_R=tile_r, TILE_C=tile_c, num_warps=4,
    )  # fmt: skip
    return res


# ---------------------------------------------------------------------------------------------
# prefill form


def _prefill_args(offset_len, max_len, out, check) -> torch.Tensor:
    width = kv_ca_index_width(max_len)
    _check_offset_len(offset_len, max_len, check)
    return index_out_buffer(out, offset_len.shape[0], width, offset_len.device)


def expand_kv_ca_index_triton(
    offset_len: torch.Tensor, max_len: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Triton kernel for :func:`expand_kv_ca_index`."""
    res = _prefill_args(offset_len, max_len, out, check)
    return _launch(offset_len, None, 1, res, paged=False)


def expand_kv_ca_index_torch(
    offset_len: torch.Tensor, max_len: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Vectorized torch path of :func:`expand_kv_ca_index`."""
    res = _prefill_args(offset_len, max_len, out, check)
    col = torch.arange(res.shape[1], dtype=torch.int32, device=offset_len.device)[None, :]
    offset, length = offset_len[:, 0:1], offset_len[:, 1:2]  # [rows, 1]
    torch.where(col < length, offset + col, col.new_full((), -1), out=res)
    return res


def expand_kv_ca_index_ref(offset_len: torch.Tensor, max_len: int) -> torch.Tensor:
    """Per-element reference (tests only)."""
    width = kv_ca_index_width(max_len)
    rows = offset_len.tolist()
    out = [[-1] * width for _ in rows]
    for r, (offset, length) in enumerate(rows):
        for c in range(length):
            out[r][c] = offset + c
    return torch.tensor(out, dtype=torch.int32).reshape(len(rows), width)


def expand_kv_ca_index(
    offset_len: torch.Tensor, max_len: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Prefill compressed index: ``out[r, c] = offset + c`` for ``c < length``, else ``-1``.

    Args:
        offset_len: int32 ``[rows, 2]`` ``(offset, length)`` per query row (``ks`` and
            ``ke - ks`` in the loaded compressed buffer); ``0 <= length <= max_len``.
        max_len: the longest row (``max_model_len // ratio``); the width is
            ``kv_ca_index_width(max_len)``.
        out: optional int32 ``[>= rows, width]`` buffer; its leading ``rows`` rows are
            overwritten, the others are left untouched.
        check: validate ``offset_len`` values (one host sync); ``False`` on hot paths.

    Returns:
        int32 ``[rows, width]`` (a view of ``out`` when given).
    """
    fn = expand_kv_ca_index_triton if use_triton(offset_len) else expand_kv_ca_index_torch
    return fn(offset_len, max_len, out=out, check=check)


# ---------------------------------------------------------------------------------------------
# decode form


def _decode_args(offset_len, block_tables, block_size, ratio, max_len, out, check):
    width = kv_ca_index_width(max_len)
    _check_offset_len(offset_len, max_len, check)
    check_tensor("block_tables", block_tables, dtype=torch.int32)
    check_same_device(offset_len=offset_len, block_tables=block_tables)
    rows = offset_len.shape[0]
    if block_tables.dim() == 2:
        if block_tables.shape[0] < rows:
            raise ValueError(f"block_tables has {block_tables.shape[0]} rows, need >= {rows}")
        if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must have unit column stride: {block_tables.stride()}")
    elif block_tables.dim() != 1 or (block_tables.dim() == 1 and block_tables.stride(0) != 1):
        raise ValueError(
            f"block_tables must be 2-D per row or 1-D contiguous, got {tuple(block_tables.shape)}"
        )
    for name, value in (("block_size", block_size), ("ratio", ratio)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if block_size % ratio:
        raise ValueError(f"block_size={block_size} must be a multiple of ratio={ratio}")
    tpb = block_size // ratio
    if check and rows:
        _check_tables(offset_len, block_tables, tpb)
    return tpb, index_out_buffer(out, rows, width, offset_len.device)


def _check_tables(offset_len: torch.Tensor, block_tables: torch.Tensor, tpb: int) -> None:
    """Every block entry a visible position reads is in the table, >= 0, and fits int32.

    Works on the table flattened to 1-D (row ``r`` of a 2-D table starts at ``r * M``) with a
    difference array marking the entries read, so the cost is O(rows + table size)."""
    rows = offset_len.shape[0]
    if block_tables.dim() == 2:
        width = block_tables.shape[1]
        flat = block_tables[:rows].reshape(-1).to(torch.int64)
        base = torch.arange(rows, device=flat.device, dtype=torch.int64) * width
    else:
        width = block_tables.shape[0]
        flat = block_tables.to(torch.int64)
        base = torch.zeros(rows, device=flat.device, dtype=torch.int64)
    offset, length = offset_len.to(torch.int64).unbind(1)
    used = length > 0
    first, last = offset // tpb, (offset + length - 1) // tpb  # blocks read, inclusive
    bad = used & (last >= width)
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ValueError(
            f"offset_len[{r}] = {offset_len[r].tolist()} reads block {int(last[r])} but "
            f"block_tables rows have {width} entries"
        )
    if not bool(used.any()):
        return
    marks = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=flat.device)
    marks.index_add_(0, (base + first)[used], torch.ones_like(first[used]))
    marks.index_add_(0, (base + last + 1)[used], -torch.ones_like(last[used]))
    entries = flat[marks.cumsum(0)[:-1] > 0]
    lo, hi = int(entries.min()), int(entries.max())
    if lo < 0:
        raise ValueError(f"block_tables holds block id {lo} at a visible position")
    check_int32("block_tables max slot", hi * tpb + tpb - 1)


def expand_kv_ca_index_decode_triton(
    offset_len: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int,
    max_len: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton kernel for :func:`expand_kv_ca_index_decode`."""
    tpb, res = _decode_args(offset_len, block_tables, block_size, ratio, max_len, out, check)
    return _launch(offset_len, block_tables, tpb, res, paged=True)


def expand_kv_ca_index_decode_torch(
    offset_len: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int,
    max_len: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path of :func:`expand_kv_ca_index_decode`."""
    tpb, res = _decode_args(offset_len, block_tables, block_size, ratio, max_len, out, check)
    rows, width = res.shape
    col = torch.arange(width, dtype=torch.int64, device=offset_len.device)[None, :]
    offset, length = offset_len[:, 0:1].long(), offset_len[:, 1:2].long()  # [rows, 1]
    visible = col < length  # [rows, width]
    pos = torch.where(visible, offset + col, 0)
    # One zero column past the end keeps hidden columns' lookups in range (even for a table
    # without columns); with check=True visible ones are known to be inside the table.
    if block_tables.dim() == 2:
        table = torch.nn.functional.pad(block_tables[:rows].long(), (0, 1))  # [rows, M + 1]
        phys = torch.gather(table, 1, (pos // tpb).clamp(0, table.shape[1] - 1))
    else:
        table = torch.nn.functional.pad(block_tables.long(), (0, 1))  # [n + 1]
        phys = table[(pos // tpb).clamp(0, table.shape[0] - 1)]
    neg = torch.full((), -1, dtype=torch.int32, device=res.device)
    torch.where(visible, (phys * tpb + pos % tpb).to(torch.int32), neg, out=res)
    return res


def expand_kv_ca_index_decode_ref(
    offset_len: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int,
    max_len: int,
) -> torch.Tensor:  # fmt: skip
    """Per-element reference (tests only)."""
    tpb = block_size // ratio
    width = kv_ca_index_width(max_len)
    tables = block_tables.tolist()
    out = [[-1] * width for _ in range(offset_len.shape[0])]
    for r, (offset, length) in enumerate(offset_len.tolist()):
        table = tables[r] if block_tables.dim() == 2 else tables
        for c in range(length):
            pos = offset + c
            out[r][c] = table[pos // tpb] * tpb + pos % tpb
    return torch.tensor(out, dtype=torch.int32).reshape(len(out), width)


def expand_kv_ca_index_decode(
    offset_len: torch.Tensor, block_tables: torch.Tensor, block_size: int, ratio: int,
    max_len: int, *, out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Decode compressed index: physical slots of the paged compressed cache.

    Args:
        offset_len: int32 ``[rows, 2]`` ``(offset, length)``; ``length`` is the row's visible
            compressed tokens (``klen``), ``0 <= length <= max_len``.
        block_tables: int32 ``[>= rows, max_num_blocks]`` per row, or a flat 1-D table (see the
            module docstring); only entries at visible positions are read, so the unused right
            part of a row may hold anything.
        block_size: raw tokens per cache block; ``ratio``: compression ratio (divides it), so a
            block holds ``tpb = block_size // ratio`` compressed tokens.
        max_len, out, check: as in :func:`expand_kv_ca_index`; ``check`` also verifies that
            every entry read lies inside the table, is ``>= 0`` and that slots fit int32.

    Returns:
        int32 ``[rows, kv_ca_index_width(max_len)]``.
    """
    paged = use_triton(offset_len)
    fn = expand_kv_ca_index_decode_triton if paged else expand_kv_ca_index_decode_torch
    return fn(offset_len, block_tables, block_size, ratio, max_len, out=out, check=check)
