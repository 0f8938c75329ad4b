"""Sliding-window index expansion: O(rows) facts from the CPU -> dense ``[rows, W]`` indices.

* ``expand_swa_index`` (prefill): each query row's window is at most two contiguous runs of the
  concatenated KV buffer ``[SWA history | this chunk's SWA keys | ...]``, described by four ints
  ``pivots[r] = (P0, P1, P2, P3)``::

      out[r, c] = P0 + c             for 0       <= c < P1        (section 1: history)
                = P2 + (c - P1)      for P1      <= c < P1 + P3   (section 2: this chunk)
                = -1                 for P1 + P3 <= c < W         (not visible)

      e.g. W = 6, pivots = (10, 2, 40, 3)  ->  [10, 11, 40, 41, 42, -1]

* ``expand_swa_index_decode``: each query row reads a window of the sequence's SWA ring that
  the query itself has already been written into. ``offset_len[r] = (start_slot, length)``
  with ``start_slot = state_id * ring + first_offset``; column ``c < length`` is the physical
  slot ``state_id * ring + (first_offset + c) % ring`` (oldest key first), the rest is -1::

      ring = 8, W = 4, offset_len = (3 * 8 + 6, 4)  ->  [30, 31, 24, 25]

Each op: public entry point (CUDA -> Triton, CPU -> torch), ``*_triton``, ``*_torch`` and a
per-element ``*_ref`` used by tests. All tensors are int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import INT32_MAX, check_int32, check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit

__all__ = [
    "expand_swa_index",
    "expand_swa_index_decode",
    "expand_swa_index_decode_ref",
    "expand_swa_index_decode_torch",
    "expand_swa_index_decode_triton",
    "expand_swa_index_ref",
    "expand_swa_index_torch",
    "expand_swa_index_triton",
    "index_out_buffer",
    "index_col_tile",
    "index_tiles",
]


def index_out_buffer(
    out: torch.Tensor | None, rows: int, width: int, device: torch.device
) -> torch.Tensor:
    """Return the ``[rows, width]`` int32 view the index ops write (shared by the index ops).

    ``out`` (optional) must be int32 ``[>= rows, width]`` on ``device`` with unit column stride;
    only its leading ``rows`` rows are written (CUDA-graph buffers sized for the largest batch).
    """
    if out is None:
        return torch.empty((rows, width), dtype=torch.int32, device=device)
    check_tensor("out", out, dtype=torch.int32, ndim=2, device=device)
    if out.shape[1] != width or out.shape[0] < rows:
        raise ValueError(f"out must have shape (>= {rows}, {width}), got {tuple(out.shape)}")
    if width > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")
    return out[:rows]


MIN_INDEX_TILE = 16
"""Narrowest column tile of the index kernels (fewer tile sizes, fewer compiled variants)."""


def index_col_tile(width: int) -> int:
    """Column tile of an index kernel over ``width`` columns: the power of two covering it,
    16 to 1,024."""
    return min(max(triton.next_power_of_2(width), MIN_INDEX_TILE), 1024)


def index_tiles(rows: int, width: int) -> tuple[int, int]:
    """(TILE_R, TILE_C) for a ``[rows, width]`` index kernel: 4K elements per program, the
    column tile `index_col_tile`. The row tile does not follow ``rows`` and the kernels do
    not specialize on their sizes: a step of a new size reuses the compiled kernels (a few
    masked lanes instead of a compile)."""
    tile_c = index_col_tile(width)
    return 4096 // tile_c, tile_c


def _check_pairs(name: str, t: torch.Tensor, ncols: int) -> torch.Tensor:
    return check_tensor(name, t, dtype=torch.int32, shape=(None, ncols))


# ---------------------------------------------------------------------------------------------
# expand_swa_index (prefill pivots)


@jit(sizes=("rows",))
def _expand_swa_index_kernel(
    piv_ptr, out_ptr, rows, width, stride_p, stride_o,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)  # [TILE_R]
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)  # [TILE_C]
    rmask = r < rows
    row = piv_ptr + r.to(tl.int64) * stride_p
    p0 = tl.load(row + 0, mask=rmask, other=0)[:, None]
    p1 = tl.load(row + 1, mask=rmask, other=0)[:, None]
    p2 = tl.load(row + 2, mask=rmask, other=0)[:, None]
    p3 = tl.load(row + 3, mask=rmask, other=0)[:, None]
    col = c[None, :]
    val = tl.where(col < p1, p0 + col, tl.where(col < p1 + p3, p2 - p1 + col, -1))
    dst = out_ptr + r.to(tl.int64)[:, None] * stride_o + col
    tl.store(dst, val, mask=rmask[:, None] & (col < width))


def _check_pivots(pivots: torch.Tensor, window_size: int) -> None:
    """Value checks (one host sync): section lengths fit the window, indices fit int32."""
    if pivots.numel() == 0:
        return
    p = pivots.to(torch.int64)
    p0, p1, p2, p3 = p.unbind(1)
    if bool(((p1 < 0) | (p3 < 0) | (p1 + p3 > window_size)).any()):
        r = int(((p1 < 0) | (p3 < 0) | (p1 + p3 > window_size)).nonzero()[0])
        raise ValueError(
            f"pivots[{r}] = {pivots[r].tolist()}: lengths P1, P3 must be >= 0 with "
            f"P1 + P3 <= window_size={window_size}"
        )
    bad = ((p1 > 0) & ((p0 < 0) | (p0 + p1 - 1 > INT32_MAX))) | (
        (p3 > 0) & ((p2 < 0) | (p2 + p3 - 1 > INT32_MAX))
    )
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ValueError(f"pivots[{r}] = {pivots[r].tolist()}: starts must be >= 0 and fit int32")


def _swa_args(pivots, window_size, out, check) -> torch.Tensor:
    _check_pairs("pivots", pivots, 4)
    if not isinstance(window_size, int) or window_size <= 0:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    if check:
        _check_pivots(pivots, window_size)
    return index_out_buffer(out, pivots.shape[0], window_size, pivots.device)


def expand_swa_index_triton(
    pivots: torch.Tensor, window_size: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Triton kernel for :func:`expand_swa_index` (any device the kernel can run on)."""
    res = _swa_args(pivots, window_size, out, check)
    rows = pivots.shape[0]
    if rows == 0:
        return res
    tile_r, tile_c = index_tiles(rows, window_size)
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(window_size, tile_c))
    _expand_swa_index_kernel[grid](
        pivots, res, rows, window_size, pivots.stride(0), res.stride(0),
        TILE_R=tile_r, TILE_C=tile_c, num_warps=4,
    )  # fmt: skip
    return res


def expand_swa_index_torch(
    pivots: torch.Tensor, window_size: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Vectorized torch path of :func:`expand_swa_index`."""
    res = _swa_args(pivots, window_size, out, check)
    col = torch.arange(window_size, dtype=torch.int32, device=pivots.device)[None, :]
    p0, p1, p2, p3 = (pivots[:, i : i + 1] for i in range(4))  # each [rows, 1]
    sec2 = torch.where(col < p1 + p3, p2 - p1 + col, -1)
    torch.where(col < p1, p0 + col, sec2, out=res)
    return res


def expand_swa_index_ref(pivots: torch.Tensor, window_size: int) -> torch.Tensor:
    """Per-element reference (tests only)."""
    rows = pivots.tolist()
    out = [[-1] * window_size for _ in rows]
    for r, (p0, p1, p2, p3) in enumerate(rows):
        for c in range(p1):
            out[r][c] = p0 + c
        for k in range(p3):
            out[r][p1 + k] = p2 + k
    return torch.tensor(out, dtype=torch.int32).reshape(len(rows), window_size)


def expand_swa_index(
    pivots: torch.Tensor, window_size: int, *, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Expand SWA pivots into the dense prefill window index (formula in the module docstring).

    Args:
        pivots: int32 ``[rows, 4]`` ``(P0, P1, P2, P3)`` per query row, any device;
            ``P1, P3 >= 0`` and ``P1 + P3 <= window_size``.
        window_size: ``W``, the output width.
        out: optional int32 ``[>= rows, W]`` buffer on the same device; its leading ``rows``
            rows are overwritten (CUDA-graph buffers), the others are left untouched.
        check: validate pivot values (one host sync); pass ``False`` on hot paths and during
            CUDA-graph capture. Shapes, dtypes and devices are always checked.

    Returns:
        int32 ``[rows, W]`` (a view of ``out`` when given).
    """
    fn = expand_swa_index_triton if use_triton(pivots) else expand_swa_index_torch
    return fn(pivots, window_size, out=out, check=check)


# ---------------------------------------------------------------------------------------------
# expand_swa_index_decode (ring start slot + length)


@jit(sizes=("rows",))
def _expand_swa_decode_kernel(
    ol_ptr, out_ptr, rows, width, ring, stride_ol, stride_o,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    rmask = r < rows
    row = ol_ptr + r.to(tl.int64) * stride_ol
    start = tl.load(row + 0, mask=rmask, other=0)
    length = tl.load(row + 1, mask=rmask, other=0)[:, None]
    first = start % ring
    base = (start - first)[:, None]  # state_id * ring
    col = c[None, :]
    pos = first[:, None] + col  # < 2 * ring for the visible columns (length <= ring)
    pos = tl.where(pos >= ring, pos - ring, pos)
    val = tl.where(col < length, base + pos, -1)
    dst = out_ptr + r.to(tl.int64)[:, None] * stride_o + col
    tl.store(dst, val, mask=rmask[:, None] & (col < width))


def _decode_args(offset_len, window_size, ring_size, out, check) -> torch.Tensor:
    _check_pairs("offset_len", offset_len, 2)
    if not isinstance(window_size, int) or window_size <= 0:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    if not isinstance(ring_size, int) or ring_size <= 0:
        raise ValueError(f"ring_size must be a positive int, got {ring_size!r}")
    if check and offset_len.numel():
        start, length = offset_len.to(torch.int64).unbind(1)
        bad = (start < 0) | (length < 0) | (length > min(window_size, ring_size))
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise ValueError(
                f"offset_len[{r}] = {offset_len[r].tolist()}: needs start_slot >= 0 and "
                f"0 <= length <= min(window_size={window_size}, ring_size={ring_size})"
            )
        check_int32("offset_len state base + ring_size", int(start.max()) + ring_size)
    return index_out_buffer(out, offset_len.shape[0], window_size, offset_len.device)


def expand_swa_index_decode_triton(
    offset_len: torch.Tensor, window_size: int, ring_size: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton kernel for :func:`expand_swa_index_decode`."""
    res = _decode_args(offset_len, window_size, ring_size, out, check)
    rows = offset_len.shape[0]
    if rows == 0:
        return res
    tile_r, tile_c = index_tiles(rows, window_size)
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(window_size, tile_c))
    _expand_swa_decode_kernel[grid](
        offset_len, res, rows, window_size, ring_size, offset_len.stride(0), res.stride(0),
        TILE_R=tile_r, TILE_C=tile_c, num_warps=4,
    )  # fmt: skip
    return res


def expand_swa_index_decode_torch(
    offset_len: torch.Tensor, window_size: int, ring_size: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path of :func:`expand_swa_index_decode`."""
    res = _decode_args(offset_len, window_size, ring_size, out, check)
    col = torch.arange(window_size, dtype=torch.int32, device=offset_len.device)[None, :]
    start, length = offset_len[:, 0:1], offset_len[:, 1:2]  # [rows, 1]
    first = start % ring_size
    slot = start - first + (first + col) % ring_size
    torch.where(col < length, slot, col.new_full((), -1), out=res)
    return res


def expand_swa_index_decode_ref(
    offset_len: torch.Tensor, window_size: int, ring_size: int
) -> torch.Tensor:
    """Per-element reference (tests only)."""
    rows = offset_len.tolist()
    out = [[-1] * window_size for _ in rows]
    for r, (start, length) in enumerate(rows):
        state, first = divmod(start, ring_size)
        for c in range(length):
            out[r][c] = state * ring_size + (first + c) % ring_size
    return torch.tensor(out, dtype=torch.int32).reshape(len(rows), window_size)


def expand_swa_index_decode(
    offset_len: torch.Tensor, window_size: int, ring_size: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Expand decode SWA windows (start slot, length) into physical ring slots.

    Args:
        offset_len: int32 ``[rows, 2]``, ``(start_slot, length)`` per query row as planning
            writes ``kv_swa_index_offset_len``: ``start_slot = state_id * ring_size +
            (p - length + 1) % ring_size`` and ``length = min(p + 1, window_size)`` for a query
            at absolute position ``p``; ``0 <= length <= min(window_size, ring_size)``.
        window_size: ``W``, the output width.
        ring_size: slots per sequence ring (``swa_block_size``; may exceed ``W``).
        out, check: as in :func:`expand_swa_index`.

    Returns:
        int32 ``[rows, W]``: physical slots, oldest key first, wrapping inside the row's ring;
        ``-1`` from column ``length`` on.
    """
    fn = expand_swa_index_decode_triton if use_triton(offset_len) else expand_swa_index_decode_torch
    return fn(offset_len, window_size, ring_size, out=out, check=check)
