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
from kvplan.ops._load_launch import _launch, scale_out_spec
from kvplan.ops.cache_geometry import (
    cache_bytes,
    flat_bytes,
    row_bases,
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


def _alloc_out(layout: KVCacheFormat, total_k: int, device: torch.device):
    if _is_cast(layout):
        return torch.empty((total_k, layout.elements), dtype=torch.bfloat16, device=device)
    vdtype = torch.float8_e4m3fn if layout.quantized_dtype == "e4m3" else torch.uint8
    values = torch.empty((total_k, layout.quantized_bytes), dtype=vdtype, device=device)
    if layout.quantized_dtype == "e2m1":
        values = values.view(torch.float4_e2m1fn_x2)
    sdtype, cols, _ = scale_out_spec(layout)
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
    sdtype, cols, _ = scale_out_spec(layout)
    s = _rows_view("out.scales", scales, total_k, cols, sdtype, device)
    return LoadedIndexKV(values, scales), v.view(torch.uint8), s.view(torch.uint8)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _prepare(kv_cache, load_segments, total_k, out, layout, check):
    layout = resolve_kv_cache_layout(kv_cache, layout)
    if layout.quantized_dtype == "int8":
        raise ValueError(
            "layout.quantized_dtype 'int8' is not supported by load_paged_kv_cache (the dense "
            "engine's int8 caches are read by the paged attention kernels or kvplan.quant)"
        )
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
        layout: the cache format; inferred when ``None``. int8 formats are refused
            (``ValueError``).
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
    sdtype, cols, row_bytes = scale_out_spec(layout)
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
