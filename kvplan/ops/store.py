"""``store_kv_cache``: quantize BF16 K/V rows and scatter them into a paged cache by slot.

``slot = block * block_size + offset``; slot -1 skips the row. CUDA tensors run the Triton
kernel (``store_kv_cache_triton``), CPU tensors the vectorized torch path
(``store_kv_cache_torch``); ``store_kv_cache_ref`` is the per-element reference for tests.
Quantization follows :mod:`kvplan.quant` (bit-exact on every path).
"""

from __future__ import annotations

import math

import torch

from kvplan import quant
from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.formats import KVCacheFormat, resolve_kv_cache_layout, split_kv_cache
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import (
    SF_KIND,
    cache_bytes,
    contiguous_strides,
    flat_bytes,
    flat_groups,
    pow2_alignment,
    row_bases,
    small_batch_tile,
    triton_cdiv,
    triton_next_pow2,
)


def _prepare(kv, kv_cache, slot_mapping, layout, check):
    layout = resolve_kv_cache_layout(kv_cache, layout)
    check_tensor("slot_mapping", slot_mapping, dtype=torch.int32, ndim=1)
    check_tensor("kv", kv, dtype=torch.bfloat16)
    check_same_device(kv_cache=kv_cache, kv=kv, slot_mapping=slot_mapping)
    n = slot_mapping.shape[0]
    if kv.dim() < 2 or kv.shape[0] != n:
        raise ValueError(f"kv must have shape [n={n}, ..., elements], got {tuple(kv.shape)}")
    elements = math.prod(kv.shape[1:])
    if elements != layout.elements:
        raise ValueError(
            f"kv has {elements} elements per token (shape {tuple(kv.shape)}) but the cache "
            f"layout {layout.note!r} stores {layout.elements}"
        )
    raw, geo = cache_bytes(kv_cache, layout)
    x = kv.reshape(n, elements).contiguous()
    if check and not _capturing(kv_cache):
        check_range("slot_mapping", slot_mapping, -1, geo.num_slots)
        check_finite_rows(x, slot_mapping)
    return layout, raw, geo, x, slot_mapping.contiguous()


def check_finite_rows(x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``check=True``: every row of ``x`` ``[n, elements]`` that is written (slot >= 0) must be
    finite; raises ``ValueError`` naming the first bad row, slot, element and value. Costs one
    pass over ``x`` and a device sync on CUDA."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    rows = x.reshape(n, -1)
    bad = ~torch.isfinite(rows).all(dim=1) & (slot_mapping >= 0)  # [n]
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    values = rows[row]
    col = int((~torch.isfinite(values)).nonzero()[0, 0])
    raise ValueError(
        f"kv row {row} (slot {int(slot_mapping[row])}) holds a non-finite value "
        f"({float(values[col])} at element {col}); check=False would store it by the rule "
        "documented in store_kv_cache"
    )


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def store_kv_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: KVCacheFormat | None = None,
    check: bool = True,
) -> None:
    """Quantize ``kv`` and write token i into slot ``slot_mapping[i]`` of ``kv_cache``.

    Args:
        kv: bfloat16 ``[n, ..., elements]`` (trailing dims are flattened into one record).
        kv_cache: the cache from :func:`kvplan.alloc_kv_cache` (uint8
            ``[num_blocks, block_size, 1, bytes_per_token]``) or a bfloat16 plain cache.
        slot_mapping: int32 ``[n]``, ``block * block_size + offset``; -1 skips the row.
        layout: the cache format; inferred from the cache when ``None``.
        check: before writing anything, verify that slots lie in
            ``[-1, num_blocks * block_size)`` and that every row with a slot >= 0 is finite
            (``ValueError`` naming ``slot_mapping`` or the ``kv`` row otherwise; one pass over
            ``kv`` and a device sync; skipped automatically during CUDA-graph capture).

    All tensors live on one device. ``n == 0`` is a no-op. A rejected call writes nothing. When
    several rows share a slot, the torch and reference paths keep the first such row; the
    Triton kernel keeps an unspecified one (such rows are padding by contract).

    Unchecked input (``check=False``) has one meaning on every path (Triton on GPU, the Triton
    interpreter, the torch path), with equal bytes: a row whose slot lies outside
    ``[0, num_blocks * block_size)`` is skipped like -1 (nothing of it is written, never part
    of a record); non-finite values of quantized formats follow :mod:`kvplan.quant`'s rule
    (the group scale comes from its finite values, +-inf stores +-QMAX of the value type, so
    it loads as the largest magnitude the group holds, and NaN stores +0); BF16 caches copy
    the bits unchanged (inf and NaN load back as themselves).

    Example::

        cache = alloc_kv_cache(4, 64, V41_FORMAT)            # [4, 64, 1, 528] uint8
        kv = torch.randn(3, 512, dtype=torch.bfloat16)
        store_kv_cache(kv, cache, torch.tensor([0, 65, -1], dtype=torch.int32))
        # token 0 -> block 0 offset 0, token 1 -> block 1 offset 1, token 2 skipped
    """
    _store(kv, kv_cache, slot_mapping, layout, check, None)


def _store(kv, kv_cache, slot_mapping, layout, check, triton) -> None:
    """Shared body of the entry points; ``triton``: None dispatches by device."""
    plan = _PLANS.get(_plan_key(kv, kv_cache, slot_mapping, layout))
    if plan is None or kv.shape[0] != slot_mapping.shape[0]:
        layout, raw, geo, x, slots = _prepare(kv, kv_cache, slot_mapping, layout, check)
        plan = _remember(kv, kv_cache, slot_mapping, layout, geo)
    else:  # metadata validated when the plan was made; only the slot values are new
        layout, geo, raw = plan[0], plan[1], kv_cache
        if raw.dtype != torch.uint8:
            raw = raw.view(torch.uint8)
        if check and not _capturing(kv_cache):
            check_range("slot_mapping", slot_mapping, -1, geo.num_slots)
            check_finite_rows(kv, slot_mapping)
        x, slots = kv, slot_mapping  # contiguous (plan condition): same bytes as a reshape
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if use_triton(raw) if triton is None else triton:
        _launch(x, raw, slots, layout, geo, None, n, plan)
    else:
        _store_torch(x.reshape(n, layout.elements), raw, slots, layout, geo)


def store_kv_cache_torch(kv, kv_cache, slot_mapping, *, layout=None, check=True) -> None:
    """Vectorized torch path of :func:`store_kv_cache` (any device)."""
    layout, raw, geo, x, slots = _prepare(kv, kv_cache, slot_mapping, layout, check)
    if x.shape[0]:
        _store_torch(x, raw, slots, layout, geo)


def store_kv_cache_triton(
    kv, kv_cache, slot_mapping, *, layout=None, check=True, config=None
) -> None:
    """Triton path of :func:`store_kv_cache` (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``config`` overrides the launch parameters (``rows``, ``num_warps``, ``hw``: hardware fp8
    conversion, default on except in the interpreter; ``fast_div``: fp32-scale formats divide
    through a per-group reciprocal + fma correction equal to ``div.rn``'s fast path, default
    = ``hw``, GPU only) for benchmarks and tests.
    """
    if config is None:
        _store(kv, kv_cache, slot_mapping, layout, check, True)
        return
    layout, raw, geo, x, slots = _prepare(kv, kv_cache, slot_mapping, layout, check)
    if x.shape[0]:
        _launch(x, raw, slots, layout, geo, config)


def _first_rows(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Indices of rows with a slot in ``[0, num_slots)`` (others are skipped, as in the
    kernel), keeping only the first row of each repeated slot."""
    rows = torch.nonzero((slots >= 0) & (slots < num_slots)).flatten()
    uniq, inverse = torch.unique(slots[rows], return_inverse=True)
    first = torch.full((uniq.numel(),), slots.numel(), dtype=torch.long, device=slots.device)
    first.scatter_reduce_(0, inverse, rows, reduce="amin")
    return first


def _store_torch(x, raw, slots, layout, geo) -> None:
    rows = _first_rows(slots, geo.num_slots)
    if rows.numel() == 0:
        return
    flat = flat_bytes(raw, geo)
    vbase, sbase = row_bases(slots[rows], geo)
    if layout.is_quantized:
        values, scales = quant.quantize(x[rows], layout)
        scale_cols = torch.arange(layout.sf_bytes, device=raw.device)
        flat[sbase[:, None] + scale_cols] = scales
    else:
        values = x[rows].view(torch.uint8)
    value_cols = torch.arange(layout.value_bytes, device=raw.device)
    flat[vbase[:, None] + value_cols] = values


def _plan_key(kv, kv_cache, slot_mapping, layout):
    """Everything the validation and the launch parameters of a call depend on, except ``n``
    (the row count, checked per call) and the slot values; ``None`` for non-tensor inputs."""
    if layout is not None and type(layout) is not KVCacheFormat:
        return None  # (unhashable or wrong types: the full path raises the usual error)
    try:
        return (
            layout, kv_cache.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.device,
            kv.dtype, kv.shape[1:], kv.stride(), kv.device, slot_mapping.dtype,
            slot_mapping.stride(), slot_mapping.device, triton_interpreting(),
        )  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None


# Plans of recent (cache, kv, slot) metadata: validated layout, geometry, launch parameters.
# Values hold no tensors (no cache is kept alive); bounded, cleared when full.
_PLANS: dict = {}
_MAX_PLANS = 256


def _remember(kv, kv_cache, slot_mapping, layout, geo):
    """Cache the plan of a validated call whose ``kv`` (e.g. ``[n, H, D]``) and slots are
    row-major for every ``n``, so the fast path may pass them unreshaped (same bytes as the
    ``[n, E]`` rows); returns the plan or ``None``."""
    if kv.stride() != contiguous_strides(kv.shape) or slot_mapping.stride() != (1,):
        return None
    if kv.shape[0] == 0 or (layout.quantized_dtype == "e2m1" and kv.shape[-1] % 2):
        return None  # (e2m1 reads bf16 pairs as int32: the last dim must split into pairs)
    plan = (layout, geo, {})
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[_plan_key(kv, kv_cache, slot_mapping, layout)] = plan
    return plan


def _launch(x, raw, slots, layout, geo, config=None, n=None, plan=None) -> None:
    """Launch the store kernel; ``plan`` (default config only) memoizes the parameters that
    do not depend on ``n``."""
    n = x.shape[0] if n is None else n
    if plan is not None and config is None:
        static = plan[2]
        if not static:
            from kvplan.ops import _store_kernels

            static.update(_static_params(layout, geo), mod=_store_kernels)
        k = static["mod"]  # kernels looked up per call (tests and benchmarks patch them)
        rows = small_batch_tile(n, static["tile"], static["interp"])
        if static["fp4"]:
            x = x if x.storage_offset() % 2 == 0 else x.clone()
            x = x.view(torch.int32)
        elif not static["quant"]:
            x = x.view(torch.uint8)
        static["kernel"](k)[(triton_cdiv(n, rows),)](
            x, slots, raw, n, *static["args"], ROWS=rows, **static["kw"]
        )
        return
    from kvplan.ops import _store_kernels as k

    config = config or {}
    if layout.is_quantized:
        elems = layout.quantized_elements
        gs, g = layout.elements_per_sf, layout.num_scales
        gs_p2, g_p2 = triton_next_pow2(gs), triton_next_pow2(g)
        fp4 = layout.quantized_dtype == "e2m1"
        rows = config.get("rows", small_batch_tile(n, _row_tile(layout, g_p2 * gs_p2)))
        hw = config.get("hw", not triton_interpreting())
        if fp4:  # the kernel reads bf16 pairs as int32 words
            x = x if x.storage_offset() % 2 == 0 else x.clone()
            x = x.view(torch.int32)
        k.store_quant_kernel[(triton_cdiv(n, rows),)](
            x, slots, raw, n, geo.num_slots, geo.block_stride,
            geo.v_stride, geo.s_block_off, geo.s_stride, BLOCK_SIZE=geo.block_size,
            E=elems, GS=gs, G=g, GS_P2=gs_p2, G_P2=g_p2,
            GB=gs // 2 if fp4 else gs, GB_P2=gs_p2 // 2 if fp4 else gs_p2,
            QB=layout.quantized_bytes, FP4=fp4, INT8=layout.quantized_dtype == "int8",
            QMAX=quant.QMAX[layout.quantized_dtype],
            SF=SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
            SEARCH=layout.scale_search, FLAT=flat_groups(layout), HW=hw,
            FAST_DIV=config.get("fast_div", hw and layout.sf_format == "fp32"), ROWS=rows, VALIGN=geo.v_align, SALIGN=geo.s_align,
            num_warps=config.get("num_warps", 4),
        )  # fmt: skip
    else:
        row_bytes = layout.value_bytes
        cols = min(triton_next_pow2(row_bytes), 2048)
        rows = config.get("rows", small_batch_tile(n, 4096 // cols))
        k.scatter_rows_kernel[(triton_cdiv(n, rows),)](
            x.view(torch.uint8), slots, raw, n, geo.num_slots,
            geo.block_stride, geo.v_stride, BLOCK_SIZE=geo.block_size,
            ROW_BYTES=row_bytes, COLS=cols, ROWS=rows, VALIGN=geo.v_align,
            SRC_ALIGN=pow2_alignment(row_bytes),
            num_warps=config.get("num_warps", 4),
        )  # fmt: skip


def _row_tile(layout, row_elements: int) -> int:
    """Rows a program of ``store_quant_kernel`` quantizes: 4,096 elements, a quarter of that
    with searched scales (their candidate loop holds more registers an element: at 8 rows of
    512 values the sm_90 code spills)."""
    return max(1, min(32, (1024 if layout.scale_search else 4096) // row_elements))


def _static_params(layout, geo) -> dict:
    """The default launch parameters of :func:`_launch` that do not depend on ``n`` (same
    values as the uncached branch computes)."""
    if not layout.is_quantized:
        row_bytes = layout.value_bytes
        cols = min(triton_next_pow2(row_bytes), 2048)
        return dict(
            quant=False, fp4=False, tile=4096 // cols, interp=triton_interpreting(),
            kernel=lambda k: k.scatter_rows_kernel,
            args=(geo.num_slots, geo.block_stride, geo.v_stride),
            kw=dict(BLOCK_SIZE=geo.block_size, ROW_BYTES=row_bytes, COLS=cols,
                    VALIGN=geo.v_align, SRC_ALIGN=pow2_alignment(row_bytes), num_warps=4),
        )  # fmt: skip
    gs, g = layout.elements_per_sf, layout.num_scales
    gs_p2, g_p2 = triton_next_pow2(gs), triton_next_pow2(g)
    fp4 = layout.quantized_dtype == "e2m1"
    hw = not triton_interpreting()
    return dict(
        quant=True, fp4=fp4, tile=_row_tile(layout, g_p2 * gs_p2), interp=not hw,
        kernel=lambda k: k.store_quant_kernel,
        args=(geo.num_slots, geo.block_stride, geo.v_stride, geo.s_block_off, geo.s_stride),
        kw=dict(
            BLOCK_SIZE=geo.block_size, E=layout.quantized_elements, GS=gs, G=g, GS_P2=gs_p2,
            G_P2=g_p2, GB=gs // 2 if fp4 else gs, GB_P2=gs_p2 // 2 if fp4 else gs_p2,
            QB=layout.quantized_bytes, FP4=fp4, INT8=layout.quantized_dtype == "int8",
            QMAX=quant.QMAX[layout.quantized_dtype],
            SF=SF_KIND[layout.sf_format], SB=4 if layout.sf_format == "fp32" else 1,
            SEARCH=layout.scale_search, FLAT=flat_groups(layout), HW=hw,
            FAST_DIV=hw and layout.sf_format == "fp32", VALIGN=geo.v_align,
            SALIGN=geo.s_align, num_warps=4,
        ),
    )  # fmt: skip


def store_kv_cache_ref(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: KVCacheFormat | None = None,
) -> None:
    """Per-token, per-element reference (tests only): scalar fp32 math, writes through the
    value/scale views of :func:`kvplan.split_kv_cache`. Rows whose slot is outside
    ``[0, num_slots)`` are skipped; of rows sharing a slot the first one wins. No checks."""
    layout = resolve_kv_cache_layout(kv_cache, layout)
    values, scales = split_kv_cache(kv_cache, layout)
    bs = kv_cache.shape[1]
    num_slots = kv_cache.shape[0] * bs
    rows = kv.reshape(kv.shape[0], -1)
    written: set[int] = set()
    for i in range(rows.shape[0]):
        slot = int(slot_mapping[i])
        if not 0 <= slot < num_slots or slot in written:
            continue
        written.add(slot)
        block, offset = divmod(slot, bs)
        xs = [float(v) for v in rows[i].float()]
        dst_v = values[block, offset].view(torch.uint8)
        if not layout.is_quantized:
            dst_v.copy_(rows[i].view(torch.uint8))
            continue
        codes, scale_bytes = [], []
        per = layout.elements_per_sf
        for g0 in range(0, len(xs), per):
            c, s = quant.quantize_group_ref(xs[g0 : g0 + per], layout)
            codes += c
            scale_bytes += s
        if layout.quantized_dtype == "e2m1":
            codes = [codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2)]
        dst_v.copy_(torch.tensor(codes, dtype=torch.uint8))
        dst_s = scales[block, offset]
        dst_s = dst_s if dst_s.dtype == torch.uint8 else dst_s.view(torch.uint8)
        dst_s.copy_(torch.tensor([int(b) for b in scale_bytes], dtype=torch.uint8))
