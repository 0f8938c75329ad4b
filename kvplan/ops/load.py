"""``load_paged_kv_cache``: gather block ranges of a paged cache into a contiguous buffer.

A load plan is int32 ``[num_segments, 4]``, rows ``[src_block, src_begin, src_end,
dst_offset]``: tokens ``src_begin .. src_end - 1`` of block ``src_block`` go to output rows
``dst_offset ..``; ``src_block == -1`` writes zeros. Plans come from
:class:`kvplan.BlockLoadPlanBuilder`. Example (block_size 4)::

    segments = [[7, 2, 4, 0],    # block 7, tokens 2..3 -> rows 0..1
                [-1, 0, 3, 2],   # three zero rows     -> rows 2..4
                [3, 0, 4, 5]]    # block 3, tokens 0..3 -> rows 5..8   (total_k = 9)

CUDA tensors run the Triton kernels of ``kvplan.ops._load_kernels``, CPU tensors the vectorized
torch path; ``load_paged_kv_cache_ref`` is the per-element reference used by tests.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvplan import quant
from kvplan._checks import INT32_MAX, check_int32, check_same_device, check_tensor
from kvplan.formats import KVCacheFormat, resolve_kv_cache_layout, split_kv_cache
from kvplan.load_plan import validate_load_plan
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.store import (
    _SF_KIND,
    cache_bytes,
    flat_bytes,
    pow2_alignment,
    row_bases,
    small_batch_tile,
    triton_next_pow2,
)


class LoadedIndexKV(NamedTuple):
    """Raw output of an index-cache load (formats with ``do_cast=False``).

    values: ``[total_k, value_bytes]`` float8_e4m3fn (e4m3) or float4_e2m1fn_x2 (e2m1, two
        elements per byte).
    scales: UE8M0 -> int32 ``[total_k, ceil(num_scales / 4)]`` (four exponent bytes per int32,
        little-endian, zero padded); e4m3 -> float8_e4m3fn ``[total_k, num_scales]``;
        fp32 -> float32 ``[total_k, num_scales]``. The last axis is dropped when it is 1.
    """

    values: torch.Tensor
    scales: torch.Tensor


def _is_cast(layout: KVCacheFormat) -> bool:
    """BF16 output: dequantizing formats and plain BF16 caches."""
    return layout.do_cast or not layout.is_quantized


def _scale_out_spec(layout: KVCacheFormat) -> tuple[torch.dtype, int, int]:
    """(dtype, columns, bytes per row) of the scales output of an index load."""
    if layout.sf_format == "ue8m0":
        cols = -(-layout.num_scales // 4)
        return torch.int32, cols, 4 * cols
    if layout.sf_format == "e4m3":
        return torch.float8_e4m3fn, layout.num_scales, layout.num_scales
    return torch.float32, layout.num_scales, layout.sf_bytes


def _alloc_out(layout: KVCacheFormat, total_k: int, device: torch.device):
    if _is_cast(layout):
        return torch.empty((total_k, layout.elements), dtype=torch.bfloat16, device=device)
    vdtype = torch.float8_e4m3fn if layout.quantized_dtype == "e4m3" else torch.uint8
    values = torch.empty((total_k, layout.quantized_bytes), dtype=vdtype, device=device)
    if layout.quantized_dtype == "e2m1":
        values = values.view(torch.float4_e2m1fn_x2)
    sdtype, cols, _ = _scale_out_spec(layout)
    shape = (total_k,) if cols == 1 else (total_k, cols)
    return LoadedIndexKV(values, torch.empty(shape, dtype=sdtype, device=device))


def _rows_view(name: str, t: object, total_k: int, width: int, dtypes, device) -> torch.Tensor:
    """``t`` as a ``[total_k, width]`` view whose rows may be strided but whose last axis is
    contiguous (``[total_k, 1, width]`` slices of a larger buffer are accepted)."""
    check_tensor(name, t, dtype=dtypes, device=device)
    if t.dim() == 0 or t.shape[0] != total_k or math.prod(t.shape[1:]) != width:
        raise ValueError(f"{name} must hold [total_k={total_k}, {width}], got {tuple(t.shape)}")
    try:
        rows = t.view(total_k, width)
    except RuntimeError:
        rows = None
    if rows is None or (width > 1 and rows.stride(1) != 1):
        raise ValueError(
            f"{name} rows must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
        )
    return rows


def _byte_outputs(layout, out, total_k, device):
    """Validate ``out`` and return (out, uint8 value rows, uint8 scale rows or None)."""
    if _is_cast(layout):
        rows = _rows_view("out", out, total_k, layout.elements, torch.bfloat16, device)
        return out, rows, None
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"out must be a (values, scales) pair for index format {layout.note!r}")
    values, scales = out
    vdtypes = (
        (torch.float8_e4m3fn, torch.uint8)
        if layout.quantized_dtype == "e4m3"
        else (torch.float4_e2m1fn_x2, torch.uint8)
    )
    v = _rows_view("out.values", values, total_k, layout.quantized_bytes, vdtypes, device)
    sdtype, cols, _ = _scale_out_spec(layout)
    s = _rows_view("out.scales", scales, total_k, cols, sdtype, device)
    return LoadedIndexKV(values, scales), v.view(torch.uint8), s.view(torch.uint8)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _prepare(kv_cache, load_segments, total_k, out, layout, check):
    layout = resolve_kv_cache_layout(kv_cache, layout)
    check_tensor("load_segments", load_segments, dtype=torch.int32, shape=(None, 4))
    check_same_device(kv_cache=kv_cache, load_segments=load_segments)
    if isinstance(total_k, bool) or not isinstance(total_k, int) or total_k < 0:
        raise ValueError(f"total_k must be a non-negative int, got {total_k!r}")
    check_int32("total_k", total_k)
    raw, geo = cache_bytes(kv_cache, layout)
    if check and not _capturing(kv_cache):
        validate_load_plan(load_segments, total_k, geo.num_blocks, geo.block_size)
    if out is None:
        out = _alloc_out(layout, total_k, kv_cache.device)
    out, vrows, srows = _byte_outputs(layout, out, total_k, kv_cache.device)
    return layout, raw, geo, out, vrows, srows, load_segments.contiguous()


def load_paged_kv_cache(
    kv_cache: torch.Tensor,
    load_segments: torch.Tensor,
    total_k: int,
    out: torch.Tensor | LoadedIndexKV | None = None,
    *,
    layout: KVCacheFormat | None = None,
    check: bool = True,
) -> torch.Tensor | LoadedIndexKV:
    """Gather the rows named by ``load_segments`` into a contiguous ``[total_k, ...]`` buffer.

    Args:
        kv_cache: cache from :func:`kvplan.alloc_kv_cache` (or a bfloat16 plain cache).
        load_segments: int32 ``[num_segments, 4]`` on the cache's device (module docstring).
        total_k: output rows.
        out: optional output written in place: bfloat16 ``[total_k, elements]`` (or any shape
            ``[total_k, ...]`` with contiguous rows, e.g. a slice of a ``[N, 1, D]`` buffer)
            for cast and BF16 formats, a ``(values, scales)`` pair shaped as in
            :class:`LoadedIndexKV` for index formats. Rows not named by the plan are left
            untouched; without ``out`` they are uninitialized (``torch.empty``).
        layout: the cache format; inferred when ``None``.
        check: validate the plan with :func:`kvplan.validate_load_plan` (ranges and overlapping
            destinations; one host copy of the plan; skipped during CUDA-graph capture).
            Unvalidated plans (``check=False``) mean the same on every path: a row is copied
            only when its source (a token in ``[0, block_size)`` of a block in
            ``[-1, num_blocks)``) and its destination (a row in ``[0, total_k)``) both exist,
            other rows of the segment are dropped; rows named twice hold unspecified bytes.

    Returns ``out`` (or the new output): a BF16 tensor for ``do_cast`` and BF16 formats,
    ``LoadedIndexKV(values, scales)`` for index formats. An empty plan launches nothing.
    """
    return _load(kv_cache, load_segments, total_k, out, layout, check, None)


def _load(kv_cache, load_segments, total_k, out, layout, check, triton):
    """Shared body of the entry points; ``triton``: None dispatches by device."""
    plan = _PLANS.get(_plan_key(kv_cache, load_segments, layout))
    if plan is None or type(total_k) is not int or not 0 <= total_k <= INT32_MAX:
        layout, raw, geo, out, vrows, srows, segs = _prepare(
            kv_cache, load_segments, total_k, out, layout, check
        )
        plan = _remember(kv_cache, load_segments, layout, geo)
    else:  # cache/plan metadata validated when the plan was made
        layout, geo, raw, segs = plan[0], plan[1], kv_cache, load_segments
        if raw.dtype != torch.uint8:
            raw = raw.view(torch.uint8)
        if check and not _capturing(kv_cache):
            validate_load_plan(load_segments, total_k, geo.num_blocks, geo.block_size)
        if out is None:
            out, vrows, srows = _alloc_rows(layout, total_k, kv_cache.device)
        else:
            out, vrows, srows = _cached_outputs(plan, layout, out, total_k, kv_cache.device)
    if segs.shape[0] == 0 or total_k == 0:
        return out
    if use_triton(raw) if triton is None else triton:
        _launch(raw, segs, vrows, srows, layout, geo, None, plan)
    else:
        _load_torch(raw, segs, vrows, srows, layout, geo)
    return out


def _out_key(out):
    """Metadata :func:`_byte_outputs` validates, except the row count; ``None`` for outputs
    the cached path does not handle (not 2-D, or not tensors)."""
    try:
        if type(out) is torch.Tensor:
            return (out.dtype, out.shape[1:], out.stride(), out.device) if out.dim() == 2 else None
        values, scales = out
        if values.dim() != 2 or scales.dim() > 2:
            return None
        return (
            type(out), values.dtype, values.shape[1:], values.stride(), values.device,
            scales.dtype, scales.shape[1:], scales.stride(), scales.device,
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


def _cached_outputs(plan, layout, out, total_k, device):
    """:func:`_byte_outputs` with the validation of ``out``'s metadata remembered in
    ``plan`` (only the row counts are checked per call)."""
    key = _out_key(out)
    seen = plan[3]
    if key is None or key not in seen:
        res = _byte_outputs(layout, out, total_k, device)
        if key is not None:
            if len(seen) >= _MAX_PLANS:
                seen.clear()
            seen[key] = True
        return res
    if type(out) is torch.Tensor:
        if out.shape[0] != total_k:
            return _byte_outputs(layout, out, total_k, device)  # raises
        return out, out, None
    values, scales = out
    if values.shape[0] != total_k or scales.shape[0] != total_k:
        return _byte_outputs(layout, out, total_k, device)  # raises
    vrows = values if values.dtype == torch.uint8 else values.view(torch.uint8)
    srows = scales if scales.dim() == 2 else scales.view(total_k, 1)
    return LoadedIndexKV(values, scales), vrows, srows.view(torch.uint8)


def _plan_key(kv_cache, load_segments, layout):
    """Everything the metadata validation and static launch parameters depend on (the
    segment count, ``total_k`` and ``out`` are handled per call); ``None`` for non-tensors."""
    if layout is not None and type(layout) is not KVCacheFormat:
        return None  # (unhashable or wrong types: the full path raises the usual error)
    try:
        return (
            layout, kv_cache.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.device,
            load_segments.dtype, load_segments.shape[1:], load_segments.stride(),
            load_segments.device, triton_interpreting(),
        )  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None


# Plans of recent (cache, plan tensor) metadata: validated layout, geometry, launch parameters.
# Values hold no tensors (no cache is kept alive); bounded, cleared when full.
_PLANS: dict = {}
_MAX_PLANS = 256


def _remember(kv_cache, load_segments, layout, geo):
    """Cache the plan of a validated call whose segment tensor is row-major ``[S, 4]``."""
    if load_segments.stride() != (4, 1):
        return None
    plan = (layout, geo, {}, {})  # layout, geometry, launch parameters, validated outs
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[_plan_key(kv_cache, load_segments, layout)] = plan
    return plan


def _alloc_rows(layout, total_k, device):
    """:func:`_alloc_out` plus the uint8 row views :func:`_byte_outputs` would return."""
    if _is_cast(layout):
        out = torch.empty((total_k, layout.elements), dtype=torch.bfloat16, device=device)
        return out, out, None
    vbytes = torch.empty((total_k, layout.quantized_bytes), dtype=torch.uint8, device=device)
    if layout.quantized_dtype == "e2m1":
        values = vbytes.view(torch.float4_e2m1fn_x2)
    else:
        values = vbytes.view(torch.float8_e4m3fn)
    sdtype, cols, row_bytes = _scale_out_spec(layout)
    sbytes = torch.empty((total_k, row_bytes), dtype=torch.uint8, device=device)
    scales = sbytes.view(sdtype)
    if cols == 1:
        scales = scales.view(total_k)
    return LoadedIndexKV(values, scales), vbytes, sbytes


def load_paged_kv_cache_torch(
    kv_cache, load_segments, total_k, out=None, *, layout=None, check=True
):
    """Vectorized torch path of :func:`load_paged_kv_cache` (any device)."""
    layout, raw, geo, out, vrows, srows, segs = _prepare(
        kv_cache, load_segments, total_k, out, layout, check
    )
    if segs.shape[0] and total_k:
        _load_torch(raw, segs, vrows, srows, layout, geo)
    return out


def load_paged_kv_cache_triton(
    kv_cache, load_segments, total_k, out=None, *, layout=None, check=True, config=None
):
    """Triton path of :func:`load_paged_kv_cache`; ``config`` (``tile_t``, ``num_warps``,
    ``hw``: hardware fp8/bf16 conversions, default on except in the interpreter) overrides the
    launch parameters for benchmarks and tests."""
    if config is None:
        return _load(kv_cache, load_segments, total_k, out, layout, check, True)
    layout, raw, geo, out, vrows, srows, segs = _prepare(
        kv_cache, load_segments, total_k, out, layout, check
    )
    if segs.shape[0] and total_k:
        _launch(raw, segs, vrows, srows, layout, geo, config)
    return out


def _expand_plan(segs: torch.Tensor, geo, total_k: int):
    """Per output row: (source slot or -1, destination row), int64. Keeps exactly the rows the
    kernels write: tokens ``t`` in ``[max(src_begin, 0), min(src_end, block_size))`` of
    segments with ``src_block`` in ``[-1, num_blocks)`` whose row ``dst_offset + t -
    src_begin`` lies in ``[0, total_k)`` (an unvalidated plan never reads or writes outside
    the cache or the output)."""
    src, begin, end, dst = segs.long().unbind(1)
    first = begin.clamp(min=0)
    length = (torch.clamp(end, max=geo.block_size) - first).clamp(min=0)
    length = torch.where((src >= -1) & (src < geo.num_blocks), length, 0)
    seg = torch.repeat_interleave(torch.arange(segs.shape[0], device=segs.device), length)
    start = torch.cumsum(length, 0) - length
    t = first[seg] + torch.arange(seg.numel(), device=segs.device) - start[seg]
    slot = torch.where(src[seg] >= 0, src[seg] * geo.block_size + t, -1)
    row = dst[seg] + t - begin[seg]
    keep = (row >= 0) & (row < total_k)
    return slot[keep], row[keep]


def _load_torch(raw, segs, vrows, srows, layout, geo) -> None:
    slot, dst = _expand_plan(segs, geo, vrows.shape[0])
    read = slot >= 0
    flat = flat_bytes(raw, geo)
    vbase, sbase = row_bases(slot.clamp(min=0), geo)
    vb = layout.value_bytes
    values = flat[vbase[:, None] + torch.arange(vb, device=raw.device)]
    values = torch.where(read[:, None], values, 0)
    if not layout.is_quantized:
        vrows.view(torch.uint8)[dst] = values
        return
    scales = flat[sbase[:, None] + torch.arange(layout.sf_bytes, device=raw.device)]
    scales = torch.where(read[:, None], scales, 0)
    if layout.do_cast:
        vrows[dst] = quant.dequantize(values, scales, layout)
        return
    vrows[dst] = values
    pad = srows.shape[1] - layout.sf_bytes
    srows[dst] = torch.nn.functional.pad(scales, (0, pad))


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
            SF=_SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
            FLAT=gs == gs_p2 and g == g_p2, HW=config.get("hw", not triton_interpreting()),
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
                SF=_SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
                FLAT=gs == gs_p2 and g == g_p2, HW=not interp, VALIGN=geo.v_align,
                SALIGN=geo.s_align, num_warps=8,
            ),
        )  # fmt: skip
    vb = layout.value_bytes
    vcols = min(triton_next_pow2(vb), 1024)
    sb_out = 0
    if layout.is_quantized:  # index format: scale rows as _scale_out_spec lays them out
        sb_out = _scale_out_spec(layout)[2]
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
    8.4 KB at block size 64), as long as at least 256 programs (~2 per SM of an H200) remain.
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


def load_paged_kv_cache_ref(kv_cache, load_segments, total_k, *, layout=None):
    """Per-token, per-element reference (tests only). Returns the BF16 rows for cast/BF16
    formats, else ``(value bytes uint8 [total_k, value_bytes], scale bytes uint8
    [total_k, sf_bytes])``; rows not named by the plan are zero."""
    layout = resolve_kv_cache_layout(kv_cache, layout)
    values, scales = split_kv_cache(kv_cache, layout)
    cast = _is_cast(layout)
    width = layout.elements if cast else layout.quantized_bytes
    out = torch.zeros(total_k, width, dtype=torch.bfloat16 if cast else torch.uint8)
    out_s = torch.zeros(total_k, layout.sf_bytes, dtype=torch.uint8)
    for src, begin, end, dst in load_segments.tolist():
        for i, t in enumerate(range(begin, end)):
            if src < 0:
                continue
            if not layout.is_quantized:
                out[dst + i] = values[src, t]
                continue
            vbytes = values[src, t].view(torch.uint8)
            sbytes = scales[src, t].contiguous().view(torch.uint8)
            if cast:
                out[dst + i] = quant.dequantize_ref(vbytes.tolist(), sbytes.tolist(), layout)
            else:
                out[dst + i] = vbytes
                out_s[dst + i] = sbytes
    return out if cast else (out, out_s)
