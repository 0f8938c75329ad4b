"""``sparse_attention_ranges``: sink attention where every query row sees column ranges of its
sources -- the shape of a prompt's visibility -- with neighbouring rows sharing key loads.

A prompt row of a DeepSeek-V4 layer sees its sliding window (a history range and a range of
the chunk's own rows) and, on a compressed layer, a prefix of its sequence's compressed
entries (every entry on HCA layers; on CSA layers while the prefix is no longer than the
indexer's top-k, which then picks all of it). Written as ranges instead of index tables::

    RangeSource(cache, ranges)   ranges int32 [T, 2P]: P = 1 or 2 (start, length) pairs;
                                 row t sees slots [start, start + length) of each pair

    out = sparse_attention_ranges(q, [RangeSource(window_rows, swa_pivots),
                                      RangeSource(entry_rows, prefix)], sinks, D ** -0.5)

The result is that of ``kvplan.ops.sparse_attention.sparse_attention`` over the expanded
index (:func:`ranges_index`): pair by pair, source by source, ``-1`` padded. CUDA tensors run
``kvplan.ops._sparse_range_kernels.sparse_ranges_kernel``: a block of ``tile_t`` rows loads
each key tile once for all its rows (``sparse_attention``'s kernel loads it once per row),
so the products differ from that kernel's only in summation order and bf16 rounding of the
probabilities. CPU tensors expand the index and run ``sparse_attention_torch``.

``blocks``: optional ``(start, end)`` int32 ``[B]`` tensors, block ``b`` the rows ``[start[b],
end[b])`` (at most ``tile_t``, one sequence's neighbours); rows in no block are left as they
are in ``out``. None: blocks of ``tile_t`` consecutive rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from kvplan._checks import check_same_device, check_tensor
from kvplan.formats import KVCacheFormat
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops import _sparse_range_kernels as _kr
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.sparse_attention import (
    _out,
    check_query,
    check_source_table,
    rope_kernel_args,
    sparse_attention_torch,
)
from kvplan.ops.sparse_sources import KeySource, flat_scales, source_address

__all__ = ["RangeSource", "range_tiling", "ranges_index", "sparse_attention_ranges"]


class RangeSource(NamedTuple):
    """One key source seen through ranges: ``cache`` (any ``KeySource`` cache), ``ranges``
    int32 ``[T, 2P]`` (``P`` = 1 or 2 ``(start, length)`` pairs per row), ``layout``
    (quantized paged caches only)."""

    cache: torch.Tensor
    ranges: torch.Tensor
    layout: KVCacheFormat | None = None


def ranges_index(ranges: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, K]`` index of ``ranges`` ``[T, 2P]``: each row's slots pair by pair, then
    ``-1``; ``K`` the longest row (at least 1)."""
    t, width = ranges.shape
    r = ranges.long()
    lens = r[:, 1::2]
    k = max(int(lens.sum(1).max()) if t else 0, 1)
    col = torch.arange(k, device=ranges.device)[None, :]
    index = torch.full((t, k), -1, dtype=torch.long, device=ranges.device)
    before = torch.zeros(t, 1, dtype=torch.long, device=ranges.device)
    for j in range(width // 2):
        start, length = r[:, 2 * j : 2 * j + 1], lens[:, j : j + 1]
        inside = (col >= before) & (col < before + length)
        index = torch.where(inside, start + col - before, index)
        before = before + length
    return index.to(torch.int32)


def _check(q, sources, sinks, blocks, check: bool):
    head_dim = check_query(q, sinks, sources, RangeSource)
    num_rows = q.shape[0]
    addrs = []
    for i, src in enumerate(sources):
        r = check_source_table(f"sources[{i}].ranges", src.ranges, num_rows)
        if r.shape[1] not in (2, 4):
            raise ValueError(
                f"sources[{i}].ranges must hold 1 or 2 (start, length) pairs a row, got "
                f"{r.shape[1]} columns"
            )
        check_same_device(q=q, sinks=sinks, cache=src.cache, ranges=r)
        addr = source_address(i, KeySource(src.cache, r, src.layout), head_dim)
        if check and num_rows:
            starts, lens = r[:, 0::2].long(), r[:, 1::2].long()
            bad = (lens < 0) | ((lens > 0) & ((starts < 0) | (starts + lens > addr.num_slots)))
            if bool(bad.any()):
                row, pair = (int(v) for v in bad.nonzero()[0])
                raise ValueError(
                    f"sources[{i}].ranges row {row} pair {pair}: (start {int(starts[row, pair])}"
                    f", length {int(lens[row, pair])}) is outside the {addr.num_slots} slots"
                )
        addrs.append(addr)
    if blocks is not None:
        if not (isinstance(blocks, tuple) and len(blocks) == 2):
            raise TypeError("blocks must be a (start, end) tuple of int32 tensors")
        start = check_tensor("blocks start", blocks[0], dtype=torch.int32, ndim=1,
                             device=q.device, contiguous=True)  # fmt: skip
        end = check_tensor("blocks end", blocks[1], dtype=torch.int32, shape=tuple(start.shape),
                           device=q.device, contiguous=True)  # fmt: skip
        if check and start.numel():
            bad = (start < 0) | (end < start) | (end > num_rows)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"blocks[{b}] = [{int(start[b])}, {int(end[b])}) is not a row range of "
                    f"the {num_rows} rows"
                )
    return addrs


def sparse_attention_ranges(
    q: torch.Tensor,
    sources: Sequence[RangeSource],
    sinks: torch.Tensor,
    scale: float,
    *,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
    **tiling,
) -> torch.Tensor:
    """Attention of every query row over its ranges of one or two sources, with sinks.

    Args:
        q: ``[T, H, D]`` fp32 / bf16 / fp16 (unit stride on D), ``D <= 512``.
        sources: one or two :class:`RangeSource` (module docstring).
        sinks: ``[H]`` per-head logits.
        scale: logit scale.
        blocks: optional row blocks (module docstring); tiling keys as in
            :func:`sparse_attention_ranges_triton`, where the rows of a block must fit.
        out, out_rope, check: as in ``kvplan.ops.sparse_attention.sparse_attention``;
            ``check`` validates the ranges and blocks (one device sync on CUDA); unchecked
            out-of-range slots read as not visible.

    Returns ``out`` (or a new tensor) ``[T, H, D]`` in q's dtype.
    """
    if use_triton(q):
        return sparse_attention_ranges_triton(q, sources, sinks, scale, blocks=blocks, out=out,
                                              out_rope=out_rope, check=check,
                                              **tiling)  # fmt: skip
    return sparse_attention_ranges_torch(q, sources, sinks, scale, blocks=blocks, out=out,
                                         out_rope=out_rope, check=check)  # fmt: skip


def sparse_attention_ranges_torch(
    q, sources, sinks, scale, *, blocks=None, out=None, out_rope=None, check=True
) -> torch.Tensor:
    """Torch path: the ranges expanded (:func:`ranges_index`) into
    ``sparse_attention_torch``, whose ``rows`` are the rows the blocks cover."""
    _check(q, sources, sinks, blocks, check)
    rows = None
    if blocks is not None:
        start, end = (b.tolist() for b in blocks)
        covered = sorted({r for s, e in zip(start, end, strict=True) for r in range(s, e)})
        rows = torch.tensor(covered, dtype=torch.int32, device=q.device)
    keys = [KeySource(s.cache, ranges_index(s.ranges), s.layout) for s in sources]
    return sparse_attention_torch(q, keys, sinks, scale, out=out, out_rope=out_rope,
                                  check=False, rows=rows)  # fmt: skip


# Launch settings where the caller gives none (H200 sweeps in bench/RESULTS.md).
RANGE_TILING: dict[str, int] = {"tile_t": 4, "tile_h": 16, "tile_n": 32, "num_warps": 8,
                                "num_stages": 2}  # fmt: skip
RANGE_TILING_FP32: dict[str, int] = {"tile_t": 1, "tile_h": 16, "tile_n": 32, "num_warps": 4,
                                     "num_stages": 2}  # fmt: skip


def range_tiling(dtype: torch.dtype) -> dict[str, int]:
    """The launch settings a query of ``dtype`` takes by default (callers building
    ``blocks`` need its ``tile_t``)."""
    return RANGE_TILING if dtype == torch.bfloat16 else RANGE_TILING_FP32


def sparse_attention_ranges_triton(
    q: torch.Tensor, sources: Sequence[RangeSource], sinks: torch.Tensor, scale: float, *,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None, check: bool = True,
    tile_t: int | None = None, tile_h: int | None = None, tile_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernel (also on CPU under ``TRITON_INTERPRET=1``). ``tile_t`` rows of
    ``tile_h`` heads a program (``tile_t * tile_h >= 16``), ``tile_n`` keys a tile; None:
    `RANGE_TILING` (fp32 queries: `RANGE_TILING_FP32`)."""
    addrs = _check(q, sources, sinks, blocks, check)
    out = _out(q, out)
    half_rd, rope_args = rope_kernel_args(q, out_rope, sinks)
    num_rows, num_heads, head_dim = q.shape
    table = range_tiling(q.dtype)
    tile_t = tile_t or table["tile_t"]
    tile_h = tile_h or table["tile_h"]
    tile_n = tile_n or table["tile_n"]
    num_warps = num_warps or table["num_warps"]
    num_stages = num_stages if num_stages is not None else table["num_stages"]
    for name, v in (("tile_t", tile_t), ("tile_h", tile_h), ("tile_n", tile_n)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if tile_t * tile_h < 16 or tile_n < 16:
        raise ValueError(f"tile_t * tile_h and tile_n must be >= 16, got {tile_t} * {tile_h} "
                         f"and {tile_n}")  # fmt: skip
    if blocks is not None and check and blocks[0].numel():
        widest = int((blocks[1] - blocks[0]).max())
        if widest > tile_t:
            raise ValueError(f"blocks hold up to {widest} rows, more than tile_t = {tile_t}")
    num_blocks = triton.cdiv(num_rows, tile_t) if blocks is None else blocks[0].numel()
    if num_rows == 0 or num_blocks == 0:
        return out
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    a0 = addrs[0]
    a1 = addrs[1] if len(addrs) > 1 else a0
    r0 = sources[0].ranges
    r1 = sources[1].ranges if len(sources) > 1 else r0
    blk = blocks if blocks is not None else (r0, r0)  # unused without BLOCKS
    interpret = triton_interpreting()
    _kr.sparse_ranges_kernel[(num_blocks, triton.cdiv(num_heads, tile_h))](
        q, out, sinks.float().contiguous(), blk[0], blk[1], num_rows, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), num_heads, scale * _k.LOG2E,
        a0.ptr, r0, r0.stride(0), a0.num_slots, a0.block_size, a0.stride_block,
        a0.stride_token, a0.scale_stride, a0.scale_offset,
        a1.ptr, r1, r1.stride(0), a1.num_slots, a1.block_size, a1.stride_block,
        a1.stride_token, a1.scale_stride, a1.scale_offset,
        *rope_args,
        HEAD_DIM=head_dim, D_P2=d_p2, TILE_T=tile_t, TILE_H=tile_h, TILE_N=tile_n,
        KIND0=a0.kind, SF0=a0.sf, GS0=a0.group, FLAT0=flat_scales(a0, head_dim, d_p2),
        PAIRS0=r0.shape[1] // 2,
        KIND1=a1.kind, SF1=a1.sf, GS1=a1.group, FLAT1=flat_scales(a1, head_dim, d_p2),
        PAIRS1=r1.shape[1] // 2, HAS1=len(sources) > 1, BLOCKS=blocks is not None,
        HW=not interpret, DOT_BF16=q.dtype == torch.bfloat16, INTERPRET=interpret,
        HALF_RD=half_rd, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
