"""Concatenate the SWA and compressed prefill index tables into one ``[rows, Wl + Wr]`` table.

The prefill attention reads one contiguous KV buffer laid out as::

    rows [0, ca_base)                 SWA history + this chunk's SWA keys
    rows [ca_base, ca_base + total_c) compressed (main) cache, loaded by its own plan

``swa_index`` already points into ``[0, ca_base)``; ``ca_index`` points into the compressed
section counted from 0, so its visible entries are shifted by ``ca_base`` (in the caller's terms
``ca_base = total_k_swa_cached + total_k_swa_cur``); ``-1`` (not visible) stays ``-1``::

    swa_index = [[3, 4, -1]], ca_index = [[0, 2, -1, -1]], ca_base = 10
    -> [[3, 4, -1, 10, 12, -1, -1]]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import INT32_MAX, check_same_device, check_tensor
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.swa_index import index_col_tile, index_out_buffer, index_tiles

__all__ = ["kv_index_cat", "kv_index_cat_ref", "kv_index_cat_torch", "kv_index_cat_triton"]


@jit(sizes=("rows",))
def _kv_index_cat_kernel(
    l_ptr, r_ptr, out_ptr, rows, width_l, width_r, ca_base,
    stride_l, stride_r, stride_o, num_tiles_l,
    TILE_R: tl.constexpr, TILE_CL: tl.constexpr, TILE_CR: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    r64 = r.to(tl.int64)[:, None]
    rmask = (r < rows)[:, None]
    tile = tl.program_id(1)
    # Distinct names per branch: Triton merges names bound in both branches, which requires
    # equal types, and the two tiles have different widths.
    if tile < num_tiles_l:  # left table: plain copy
        cl = (tile * TILE_CL + tl.arange(0, TILE_CL))[None, :]
        mask_l = rmask & (cl < width_l)
        left = tl.load(l_ptr + r64 * stride_l + cl, mask=mask_l)
        tl.store(out_ptr + r64 * stride_o + cl, left, mask=mask_l)
    else:  # right table: shift visible entries by ca_base
        cr = ((tile - num_tiles_l) * TILE_CR + tl.arange(0, TILE_CR))[None, :]
        mask_r = rmask & (cr < width_r)
        right = tl.load(r_ptr + r64 * stride_r + cr, mask=mask_r)
        right = tl.where(right != -1, right + ca_base, -1)
        tl.store(out_ptr + r64 * stride_o + width_l + cr, right, mask=mask_r)


def _check_table(name: str, t: torch.Tensor) -> torch.Tensor:
    check_tensor(name, t, dtype=torch.int32, ndim=2)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
    return t


def _cat_args(swa_index, ca_index, ca_base, out, check) -> torch.Tensor:
    _check_table("swa_index", swa_index)
    _check_table("ca_index", ca_index)
    check_same_device(swa_index=swa_index, ca_index=ca_index)
    if ca_index.shape[0] != swa_index.shape[0]:
        raise ValueError(
            f"ca_index has {ca_index.shape[0]} rows but swa_index has {swa_index.shape[0]}"
        )
    if isinstance(ca_base, bool) or not isinstance(ca_base, int) or ca_base < 0:
        raise ValueError(f"ca_base must be an int >= 0, got {ca_base!r}")
    if ca_base > INT32_MAX:
        raise ValueError(f"ca_base = {ca_base} overflows int32")
    if check and ca_index.numel():
        lo, hi = int(ca_index.min()), int(ca_index.max())
        if lo < -1:
            raise ValueError(f"ca_index holds {lo}; entries must be >= -1")
        if hi + ca_base > INT32_MAX:
            raise ValueError(f"ca_index entry {hi} + ca_base {ca_base} overflows int32")
    width = swa_index.shape[1] + ca_index.shape[1]
    return index_out_buffer(out, swa_index.shape[0], width, swa_index.device)


def kv_index_cat_triton(
    swa_index: torch.Tensor, ca_index: torch.Tensor, ca_base: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Triton kernel for :func:`kv_index_cat`."""
    res = _cat_args(swa_index, ca_index, ca_base, out, check)
    rows, width_l = swa_index.shape
    width_r = ca_index.shape[1]
    if rows == 0 or width_l + width_r == 0:
        return res
    tile_r, _ = index_tiles(rows, max(width_l, width_r))
    tile_cl, tile_cr = index_col_tile(width_l), index_col_tile(width_r)
    num_tiles_l = triton.cdiv(width_l, tile_cl)
    grid = (triton.cdiv(rows, tile_r), num_tiles_l + triton.cdiv(width_r, tile_cr))
    _kv_index_cat_kernel[grid](
        swa_index, ca_index, res, rows, width_l, width_r, ca_base,
        swa_index.stride(0), ca_index.stride(0), res.stride(0), num_tiles_l,
        TILE_R=tile_r, TILE_CL=tile_cl, TILE_CR=tile_cr, num_warps=4,
    )  # fmt: skip
    return res


def kv_index_cat_torch(
    swa_index: torch.Tensor, ca_index: torch.Tensor, ca_base: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path of :func:`kv_index_cat`."""
    res = _cat_args(swa_index, ca_index, ca_base, out, check)
    width_l = swa_index.shape[1]
    res[:, :width_l].copy_(swa_index)
    torch.where(ca_index != -1, ca_index + ca_base, ca_index, out=res[:, width_l:])
    return res


def kv_index_cat_ref(swa_index: torch.Tensor, ca_index: torch.Tensor, ca_base: int) -> torch.Tensor:
    """Per-element reference (tests only)."""
    rows = [
        list(left) + [-1 if v == -1 else v + ca_base for v in right]
        for left, right in zip(swa_index.tolist(), ca_index.tolist(), strict=True)
    ]
    width = swa_index.shape[1] + ca_index.shape[1]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)


def kv_index_cat(
    swa_index: torch.Tensor, ca_index: torch.Tensor, ca_base: int, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Concatenate the SWA index and the shifted compressed index (see the module docstring).

    Args:
        swa_index: int32 ``[rows, Wl]`` (unit column stride, any row stride), copied as is.
        ca_index: int32 ``[rows, Wr]`` on the same device; entries ``>= -1``.
        ca_base: first row of the compressed section in the concatenated KV buffer
            (``total_k_swa_cached + total_k_swa_cur``).
        out: optional int32 ``[>= rows, Wl + Wr]`` buffer; its leading ``rows`` rows are
            overwritten, the others are left untouched.
        check: validate ``ca_index`` values (one host sync); ``False`` on hot paths.

    Returns:
        int32 ``[rows, Wl + Wr]`` (a view of ``out`` when given).
    """
    fn = kv_index_cat_triton if use_triton(swa_index) else kv_index_cat_torch
    return fn(swa_index, ca_index, ca_base, out=out, check=check)
