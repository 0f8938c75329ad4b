"""Triton launch of the paged load: grid sizing, static parameters and the planned fast
path (`kvplan.ops.load` validates and dispatches; the kernels live in `_load_kernels`)."""

from __future__ import annotations

import torch

from kvplan.formats import KVCacheFormat
from kvplan.ops._dispatch import triton_interpreting
from kvplan.ops.cache_geometry import (
    SF_KIND,
    flat_groups,
    pow2_alignment,
    small_batch_tile,
    triton_next_pow2,
)


def scale_out_spec(layout: KVCacheFormat) -> tuple[torch.dtype, int, int]:
    """(dtype, columns, bytes per row) of the scales output of an index load."""
    if layout.sf_format == "ue8m0":
        cols = -(-layout.num_scales // 4)
        return torch.int32, cols, 4 * cols
    if layout.sf_format == "e4m3":
        return torch.float8_e4m3fn, layout.num_scales, layout.num_scales
    return torch.float32, layout.num_scales, layout.sf_bytes


def _launch(raw, segs, vrows, srows, layout, geo, config=None, plan=None) -> None:
    num_segments = segs.shape[0]
    if plan is not None and config is None:
        _launch_planned(raw, segs, vrows, srows, layout, geo, plan[2])
        return
    from kvplan.ops import _load_kernels as k

    config = config or {}
    common = (geo.num_blocks, geo.block_size, vrows.shape[0], geo.block_stride, geo.v_stride,
              geo.s_block_off, geo.s_stride)  # fmt: skip
    if layout.is_quantized and layout.do_cast:
        gs, g = layout.elements_per_sf, layout.num_scales
        gs_p2, g_p2 = triton_next_pow2(gs), triton_next_pow2(g)
        fp4 = layout.quantized_dtype == "e2m1"
        tile = min(triton_next_pow2(geo.block_size), max(1, 8192 // (g_p2 * gs_p2)))
        tile = config.get("tile_t", _grid_safe(small_batch_tile(vrows.shape[0], tile), geo))
        out16 = vrows.view(torch.int16)
        segs_per = config.get("segs", 1)
        k.load_cast_kernel[(-(-num_segments // segs_per), -(-geo.block_size // tile))](
            raw, segs, num_segments, out16, out16.stride(0), *common,
            E=layout.quantized_elements, GS=gs, G=g, GS_P2=gs_p2, G_P2=g_p2,
            GB=gs // 2 if fp4 else gs, GB_P2=gs_p2 // 2 if fp4 else gs_p2, FP4=fp4,
            SF=SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
            FLAT=flat_groups(layout), HW=config.get("hw", not triton_interpreting()),
            TILE_T=tile, SEGS=segs_per, VALIGN=geo.v_align, SALIGN=geo.s_align,
            OALIGN=pow2_alignment(out16.stride(0), cap=8),
            num_warps=config.get("num_warps", 8),
        )  # fmt: skip
        return
    vbytes = vrows.view(torch.uint8)
    vb = layout.value_bytes
    vcols = min(triton_next_pow2(vb), 1024)
    sbytes = srows if srows is not None else vbytes
    sb_out = srows.shape[1] if srows is not None else 0
    tile = min(triton_next_pow2(geo.block_size), max(1, 8192 // vcols))
    tile = config.get("tile_t", _grid_safe(small_batch_tile(vrows.shape[0], tile), geo))
    row_bytes = vb + layout.sf_bytes
    segs_per = config.get("segs", raw_segments_per_program(num_segments, tile, row_bytes, geo))
    num_warps = config.get("num_warps", 8 if segs_per * tile * row_bytes >= 32768 else 4)
    k.load_raw_kernel[(-(-num_segments // segs_per), -(-geo.block_size // tile))](
        raw, segs, num_segments, vbytes, vbytes.stride(0), sbytes, sbytes.stride(0), *common,
        VB=vb, VCOLS=vcols, SB_IN=layout.sf_bytes, SB_OUT=sb_out,
        SCOLS=triton_next_pow2(max(sb_out, 1)), TILE_T=tile, SEGS=segs_per, VALIGN=geo.v_align,
        SALIGN=geo.s_align, OVALIGN=pow2_alignment(vbytes.stride(0)),
        OSALIGN=pow2_alignment(sbytes.stride(0)),
        num_warps=num_warps,
    )  # fmt: skip


def _launch_planned(raw, segs, vrows, srows, layout, geo, static) -> None:
    """The default-config branch of :func:`_launch` with the ``total_k``-independent
    parameters memoized in ``static`` (same values, same kernel arguments)."""
    if not static:
        from kvplan.ops import _load_kernels

        static.update(_static_params(layout, geo), mod=_load_kernels)
    k = static["mod"]  # kernels looked up per call (tests and benchmarks patch them)
    num_segments, total_k, interp = segs.shape[0], vrows.shape[0], static["interp"]
    tile = _grid_safe(small_batch_tile(total_k, static["tile"], interp), geo)
    grid = (num_segments, -(-geo.block_size // tile))
    if static["cast"]:
        out16 = vrows.view(torch.int16)
        ostride = out16.stride(0)
        k.load_cast_kernel[grid](
            raw, segs, num_segments, out16, ostride, geo.num_blocks, geo.block_size,
            total_k, *static["common"], TILE_T=tile, SEGS=1,
            OALIGN=_memo_align(static, ostride, 8), **static["kw"],
        )  # fmt: skip
        return
    vbytes = vrows if vrows.dtype == torch.uint8 else vrows.view(torch.uint8)
    sbytes = srows if srows is not None else vbytes
    row_bytes = static["row_bytes"]
    segs_per = raw_segments_per_program(num_segments, tile, row_bytes, geo, interp)
    grid = (-(-num_segments // segs_per), grid[1])
    k.load_raw_kernel[grid](
        raw, segs, num_segments, vbytes, vbytes.stride(0), sbytes, sbytes.stride(0),
        geo.num_blocks, geo.block_size, total_k, *static["common"],
        SB_OUT=static["sb_out"], SCOLS=static["scols"], TILE_T=tile, SEGS=segs_per,
        OVALIGN=_memo_align(static, vbytes.stride(0), 16),
        OSALIGN=_memo_align(static, sbytes.stride(0), 16),
        num_warps=8 if segs_per * tile * row_bytes >= 32768 else 4, **static["kw"],
    )  # fmt: skip


def _memo_align(static: dict, stride: int, cap: int) -> int:
    """``pow2_alignment(stride, cap=cap)``, memoized per plan (output row strides repeat)."""
    memo = static["align"]
    key = (stride, cap)
    align = memo.get(key)
    if align is None:
        if len(memo) >= 64:
            memo.clear()
        align = memo[key] = pow2_alignment(stride, cap=cap)
    return align


def _static_params(layout, geo) -> dict:
    """Launch parameters of :func:`_launch`'s default config that depend only on the format,
    the cache geometry and interpreter mode."""
    interp = triton_interpreting()
    common = (geo.block_stride, geo.v_stride, geo.s_block_off, geo.s_stride)
    if layout.is_quantized and layout.do_cast:
        gs, g = layout.elements_per_sf, layout.num_scales
        gs_p2, g_p2 = triton_next_pow2(gs), triton_next_pow2(g)
        fp4 = layout.quantized_dtype == "e2m1"
        return dict(
            cast=True, interp=interp, common=common, align={},
            tile=min(triton_next_pow2(geo.block_size), max(1, 8192 // (g_p2 * gs_p2))),
            kw=dict(
                E=layout.quantized_elements, GS=gs, G=g, GS_P2=gs_p2, G_P2=g_p2,
                GB=gs // 2 if fp4 else gs, GB_P2=gs_p2 // 2 if fp4 else gs_p2, FP4=fp4,
                SF=SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
                FLAT=flat_groups(layout), HW=not interp, VALIGN=geo.v_align,
                SALIGN=geo.s_align, num_warps=8,
            ),
        )  # fmt: skip
    vb = layout.value_bytes
    vcols = min(triton_next_pow2(vb), 1024)
    sb_out = 0
    if layout.is_quantized:  # index format: scale rows as _scale_out_spec lays them out
        sb_out = scale_out_spec(layout)[2]
    return dict(
        cast=False, interp=interp, common=common, row_bytes=vb + layout.sf_bytes, align={},
        tile=min(triton_next_pow2(geo.block_size), max(1, 8192 // vcols)), sb_out=sb_out,
        scols=triton_next_pow2(max(sb_out, 1)),
        kw=dict(VB=vb, VCOLS=vcols, SB_IN=layout.sf_bytes, VALIGN=geo.v_align,
                SALIGN=geo.s_align),
    )  # fmt: skip


def raw_segments_per_program(
    num_segments: int, tile: int, row_bytes: int, geo, interpreting: bool | None = None
) -> int:
    """Segments per program of the raw (index / BF16) load: a power of two that brings a
    program to about 32 KB of record bytes (one block of a 132-byte index format is only
    8.4 KB at block size 64), as long as at least 256 programs (about 2 per SM of a 132-SM GPU) remain.
    Returns 1 when the tile does not cover the whole block (several programs per segment
    already) and in the CPU interpreter (tests pick ``segs`` explicitly; ``interpreting``:
    that mode, read from the environment when ``None``)."""
    if interpreting is None:
        interpreting = triton_interpreting()
    if interpreting or tile < geo.block_size:
        return 1
    segs = 1
    while 2 * segs * tile * row_bytes <= 36864 and -(-num_segments // (2 * segs)) >= 256:
        segs *= 2
    return segs


def _grid_safe(tile: int, geo) -> int:
    """Grow ``tile`` (a power of two) until cdiv(block_size, tile) fits CUDA's grid y limit."""
    while -(-geo.block_size // tile) > 65535:
        tile *= 2
    return tile
