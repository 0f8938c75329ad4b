"""``sparse_attention``: attention with per-head sinks over index tables into key sources.

Query row ``t`` sees, for each source ``i``, the rows named by ``index_i[t, :]`` (``-1`` = not
visible); keys and values are the same rows (one shared K=V head). A source is a cache read
in place -- no gathered copy -- in one of three shapes::

    plain rows      fp32 / bf16 [N, D]                      slot s = row s
    plain paged     fp32 / bf16 [num_blocks, block_size, 1, D]
    quantized paged uint8 [num_blocks, block_size, 1, bytes_per_token] + layout
                    (token-interleaved record: e4m3 or e2m1 values, UE8M0 or e4m3 scales,
                    e.g. V41_FORMAT / V41_FP4_FORMAT; dequantized in registers)
    paged slot s = block s // block_size, row s % block_size

Example: decode of a DeepSeek-V4 CSA layer reads the SWA ring through ``kv_swa_index`` (ring
slots) and the compressed pool through the top-k slots::

    out = sparse_attention(q, [KeySource(ring_cache, swa_slots, V41_FORMAT),
                               KeySource(pool_cache, topk_slots, V41_FORMAT)], sinks, D ** -0.5)

Math (fp32; ``v_k`` the dequantized row of column ``k`` over both sources)::

    l_k = scale * q[t, h] . v_k,   m = max(max_k l_k, sinks[h])
    out[t, h] = sum_k exp(l_k - m) v_k / (sum_k exp(l_k - m) + exp(sinks[h] - m))

A row that sees nothing gets zeros. A dequantized row equals what ``load_paged_kv_cache``
returns for it (``bf16(value * scale)``; exact for these layouts). CUDA tensors run the Triton
kernel of ``kvplan.ops._sparse_attention_kernels`` (bf16 queries multiply in bf16, fp32 queries
in fp32); CPU tensors run ``sparse_attention_torch``; ``sparse_attention_ref`` is a per-row
loop for tests.

``index_scores`` is the lightning indexer's scoring over the same addressing (index keys in
the split index layouts read in place) and ``topk_columns`` its top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from kvplan import quant
from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.formats import KVCacheFormat, resolve_kv_cache_layout, split_kv_cache
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops import _sparse_split_kernels as _ks
from kvplan.ops._dispatch import triton_interpreting, use_triton

MAX_HEAD_DIM = 512
_ROWS_PER_CHUNK = 128  # torch path: bounds the [rows, H, K] logits held at once


class KeySource(NamedTuple):
    """One key source: ``cache`` (see the module docstring), ``index`` int32 ``[T, K]`` slots
    (``-1`` = not visible), ``layout`` (quantized paged caches only)."""

    cache: torch.Tensor
    index: torch.Tensor
    layout: KVCacheFormat | None = None


class _Addr(NamedTuple):
    """How the kernel addresses one source (strides in elements of ``ptr``'s dtype)."""

    ptr: torch.Tensor
    kind: int
    sf: int
    group: int
    num_slots: int
    block_size: int
    stride_block: int
    stride_token: int
    scale_stride: int
    scale_offset: int


_SF = {"ue8m0": _k.SF_UE8M0, "e4m3": _k.SF_E4M3, "fp32": _k.SF_FP32}


def _address(i: int, src: KeySource, head_dim: int, *, split_ok: bool = False) -> _Addr:
    """Kernel addressing of source ``i``; ``split_ok`` admits split (index) layouts."""
    name = f"sources[{i}].cache"
    cache, layout = src.cache, src.layout
    if layout is not None and layout.is_quantized:
        layout = resolve_kv_cache_layout(check_tensor(name, cache, dtype=torch.uint8), layout)
        if not (split_ok or (layout.do_cast and layout.token_interleaved)):
            raise ValueError(
                f"{name}: layout {layout.note!r} must be a token-interleaved cast layout"
            )
        if layout.sf_format not in _SF or (layout.sf_format == "fp32" and not split_ok):
            raise ValueError(f"{name}: scale format {layout.sf_format!r} is not supported")
        if layout.elements != head_dim:
            raise ValueError(f"{name}: layout has {layout.elements} elements, q has D = {head_dim}")
        kind = _k.KIND_E4M3 if layout.quantized_dtype == "e4m3" else _k.KIND_E2M1
        nb, bs = cache.shape[0], cache.shape[1]
        vb, bpt = layout.value_bytes, layout.bytes_per_token
        if layout.token_interleaved:
            stride_token, scale_stride, scale_offset = bpt, bpt, vb
        else:
            stride_token, scale_stride, scale_offset = vb, layout.sf_bytes, bs * vb
        return _Addr(cache, kind, _SF[layout.sf_format], layout.elements_per_sf, nb * bs, bs,
                     cache.stride(0), stride_token, scale_stride, scale_offset)  # fmt: skip
    if layout is not None and layout.elements != head_dim:
        raise ValueError(f"{name}: layout has {layout.elements} elements, q has D = {head_dim}")
    check_tensor(name, cache, dtype=(torch.float32, torch.bfloat16))
    kind = _k.KIND_FP32 if cache.dtype == torch.float32 else _k.KIND_BF16
    if cache.dim() == 2:
        check_tensor(name, cache, shape=(None, head_dim))
        if head_dim > 1 and cache.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride on D, got strides {cache.stride()}")
        return _Addr(cache, kind, 0, 1, cache.shape[0], 1, cache.stride(0), 0, 0, 0)
    check_tensor(name, cache, shape=(None, None, 1, head_dim))
    if head_dim > 1 and cache.stride(3) != 1:
        raise ValueError(f"{name} must have unit stride on D, got strides {cache.stride()}")
    nb, bs = cache.shape[0], cache.shape[1]
    return _Addr(cache, kind, 0, 1, nb * bs, bs, cache.stride(0), cache.stride(1), 0, 0)


def _flat(a: _Addr, head_dim: int, d_p2: int) -> bool:
    """Whole, power-of-two scale groups tile the row: scales load as ``[TILE_N, G]``."""
    if a.kind < _k.KIND_E4M3 or head_dim != d_p2 or head_dim % a.group:
        return False
    groups = head_dim // a.group
    return groups & (groups - 1) == 0


def _check(q, sources, sinks, check_values: bool) -> list[_Addr]:
    check_tensor("q", q, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=3)
    num_rows, num_heads, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if head_dim > 1 and q.stride(2) != 1:
        raise ValueError(f"q must have unit stride on D, got strides {q.stride()}")
    check_tensor("sinks", sinks, shape=(num_heads,))
    if not 1 <= len(sources) <= 2:
        raise ValueError(f"sources must hold 1 or 2 KeySource, got {len(sources)}")
    addrs = []
    for i, src in enumerate(sources):
        if not isinstance(src, KeySource):
            raise TypeError(f"sources[{i}] must be a KeySource, got {type(src).__name__}")
        idx = check_tensor(f"sources[{i}].index", src.index, dtype=torch.int32, ndim=2)
        if idx.shape[0] != num_rows:
            raise ValueError(f"sources[{i}].index has {idx.shape[0]} rows, q has {num_rows}")
        if idx.shape[1] > 0 and idx.stride(1) != 1:
            raise ValueError(f"sources[{i}].index must have unit column stride")
        check_same_device(q=q, sinks=sinks, cache=src.cache, index=idx)
        addr = _address(i, src, head_dim)
        if check_values:
            check_range(f"sources[{i}].index", idx, -1, addr.num_slots)
        addrs.append(addr)
    return addrs


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sinks: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention of every query row over its indexed rows of one or two sources, with sinks.

    Args:
        q: ``[T, H, D]`` fp32 / bf16 / fp16 (unit stride on D), ``D <= 512``.
        sources: one or two :class:`KeySource` (module docstring), index rows ``[T, K_i]``.
        sinks: ``[H]`` per-head logits (finite, or ``-inf`` for no sink).
        scale: logit scale.
        out: optional ``[T, H, D]`` destination of q's dtype (written in place).
        check: validate index values (one device sync on CUDA); False on a hot path, where
            an out-of-range slot reads as not visible.

    Returns ``out`` (or a new tensor) ``[T, H, D]`` in q's dtype.
    """
    if use_triton(q):
        return sparse_attention_triton(q, sources, sinks, scale, out=out, check=check)
    return sparse_attention_torch(q, sources, sinks, scale, out=out, check=check)


def _out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)


def sparse_attention_triton(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None, check: bool = True, tile_h: int = 16,
    tile_n: int | None = None, num_warps: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernels (also on CPU under ``TRITON_INTERPRET=1``); contract of
    :func:`sparse_attention`. ``tile_h`` heads and ``tile_n`` keys per tile; ``num_splits``
    column splits per (row, head group) (``kvplan.ops._sparse_split_kernels``; 1: one
    program walks all of a row's columns; None: :func:`split_count` on CUDA, 1 otherwise)."""
    addrs = _check(q, sources, sinks, check)
    out = _out(q, out)
    num_rows, num_heads, head_dim = q.shape
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    tile_n = tile_n or (16 if d_p2 >= 512 else 32)
    num_warps = num_warps or (8 if d_p2 >= 512 else 4)
    interpret = triton_interpreting()
    if num_rows == 0:
        return out
    a0 = addrs[0]
    a1 = addrs[1] if len(addrs) > 1 else a0
    i0 = sources[0].index
    i1 = sources[1].index if len(sources) > 1 else i0
    n1 = i1.shape[1] if len(sources) > 1 else 0
    num_cols = i0.shape[1] + n1
    groups = triton.cdiv(num_heads, tile_h)
    if num_splits is None:
        num_splits = (
            1
            if interpret or not q.is_cuda
            else split_count(num_rows * groups, num_cols, tile_n, _num_sms(q.device))
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    cols_per_split = triton.cdiv(triton.cdiv(max(num_cols, 1), num_splits), tile_n) * tile_n
    num_splits = triton.cdiv(max(num_cols, 1), cols_per_split)

    sink32 = sinks.float().contiguous()
    srcs = (
        a0.ptr, i0, i0.stride(0), i0.shape[1], a0.num_slots, a0.block_size, a0.stride_block,
        a0.stride_token, a0.scale_stride, a0.scale_offset,
        a1.ptr, i1, i1.stride(0), n1, a1.num_slots, a1.block_size, a1.stride_block,
        a1.stride_token, a1.scale_stride, a1.scale_offset,
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=head_dim, D_P2=d_p2, TILE_H=tile_h, TILE_N=tile_n,
        KIND0=a0.kind, SF0=a0.sf, GS0=a0.group, FLAT0=_flat(a0, head_dim, d_p2),
        KIND1=a1.kind, SF1=a1.sf, GS1=a1.group, FLAT1=_flat(a1, head_dim, d_p2),
        HAS1=len(sources) > 1, HW=not interpret,
        DOT_BF16=q.dtype == torch.bfloat16 and not interpret, INTERPRET=interpret,
        num_warps=num_warps,
    )  # fmt: skip
    if num_splits == 1:
        _k.sparse_attention_kernel[(num_rows, groups)](
            q, out, sink32, q.stride(0), q.stride(1), out.stride(0), out.stride(1), num_heads,
            scale * _k.LOG2E, *srcs, **consts,
        )  # fmt: skip
        return out
    ws_m = torch.empty((num_rows, num_splits, num_heads), dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty((*ws_m.shape, head_dim), dtype=torch.float32, device=q.device)
    _ks.sparse_attention_split_kernel[(num_rows, groups, num_splits)](
        q, ws_acc, ws_m, ws_l, q.stride(0), q.stride(1), num_heads, num_splits, cols_per_split,
        scale * _k.LOG2E, *srcs, **consts,
    )  # fmt: skip
    _ks.sparse_attention_combine_kernel[(num_rows, groups)](
        out, sink32, ws_acc, ws_m, ws_l, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, D_P2=d_p2, TILE_H=tile_h, INTERPRET=interpret, num_warps=4,
    )  # fmt: skip
    return out


_PROGRAMS_PER_SM = 2  # split target: about this many programs per SM
_MIN_SPLIT_TILES = 2  # fewest key tiles a split walks


def split_count(num_programs: int, num_cols: int, tile_n: int, num_sms: int) -> int:
    """Column splits per (row, head group) for ``num_programs`` (row, head group) pairs over
    ``num_cols`` joined columns: 1 when those programs already fill ``num_sms`` SMs, else
    about ``_PROGRAMS_PER_SM`` programs per SM, each walking at least ``_MIN_SPLIT_TILES``
    tiles of ``tile_n`` columns. Depends on the shapes only (fixed under a CUDA graph)."""
    if num_programs >= num_sms or num_cols <= tile_n * _MIN_SPLIT_TILES:
        return 1
    want = triton.cdiv(_PROGRAMS_PER_SM * num_sms, num_programs)
    return max(1, min(want, num_cols // (tile_n * _MIN_SPLIT_TILES)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def index_scores(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    keys: KeySource,
    *,
    check: bool = True,
) -> torch.Tensor:
    """The lightning indexer's scores of every candidate, reading the index keys in place.

    Args:
        index_q: ``[T, Hi, Ci]`` fp32 / bf16 indexer queries (unit stride on Ci), ``Hi <= 128``.
        index_weights: ``[T, Hi]`` per-head weights (all scalings folded in).
        keys: a :class:`KeySource` over the index keys: plain rows, or a quantized paged
            cache in a split index layout (``MXFP8_INDEX_KV_FORMAT``,
            ``FP8_FLOAT32_SF_INDEX_KV_FORMAT``, ``FP4_INDEX_KV_FORMAT`` or the same layouts at
            other widths) or a token-interleaved one; ``keys.index`` int32 ``[T, K]`` slots.
        check: validate slot values (one device sync on CUDA).

    Returns fp32 ``[T, K]``: ``sum_h index_weights[t, h] * relu(index_q[t, h] . key)``
    (fp32 products), ``-inf`` where the slot is ``-1``.
    """
    check_tensor("index_q", index_q, dtype=(torch.float32, torch.bfloat16), ndim=3)
    num_rows, num_heads, width = index_q.shape
    check_tensor("index_weights", index_weights, shape=(num_rows, num_heads))
    if not 1 <= num_heads <= 128 or width > MAX_HEAD_DIM:
        raise ValueError(f"index_q: need 1 <= Hi <= 128 and Ci <= 512, got {(num_heads, width)}")
    idx = check_tensor("keys.index", keys.index, dtype=torch.int32, ndim=2)
    if idx.shape[0] != num_rows:
        raise ValueError(f"keys.index has {idx.shape[0]} rows, index_q has {num_rows}")
    check_same_device(index_q=index_q, index_weights=index_weights, cache=keys.cache, index=idx)
    addr = _address(0, keys, width, split_ok=True)
    if check:
        check_range("keys.index", idx, -1, addr.num_slots)
    if not use_triton(index_q):
        rows = gather_rows(keys, idx)  # [T, K, Ci]
        dots = torch.einsum("thc,tkc->thk", index_q.float(), rows).relu()
        scores = torch.einsum("thk,th->tk", dots, index_weights.float())
        return scores.masked_fill(idx < 0, float("-inf"))
    return index_scores_triton(index_q, index_weights, keys, addr)


def index_scores_triton(
    index_q: torch.Tensor, index_weights: torch.Tensor, keys: KeySource,
    addr: _Addr | None = None, *, tile_n: int | None = None, tiles: int = 1,
    num_warps: int | None = None, legacy: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The Triton path of :func:`index_scores` (inputs checked there; ``addr`` its
    addressing of ``keys``). ``index_scores_tc_kernel``: ``tile_n`` keys per dot, ``tiles``
    key tiles per program; bf16 queries use the tensor cores (bf16 x bf16-exact keys, fp32
    accumulation: exact products; fp32 rows are not bf16-exact and keep fp32), fp32 queries
    fp32 ``"ieee"`` products. ``legacy``: the
    per-tile CUDA-core kernel ``index_scores_kernel`` (fp32 products for every query)."""
    idx = keys.index
    addr = addr or _address(0, keys, index_q.shape[2], split_ok=True)
    num_rows, num_heads, width = index_q.shape
    out = torch.empty(idx.shape, dtype=torch.float32, device=idx.device)
    if idx.numel() == 0:
        return out
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    w = index_weights.float().contiguous()
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    d_p2 = max(16, triton.next_power_of_2(width))
    interpret = triton_interpreting()
    args = (
        q, w, out, addr.ptr, idx, q.stride(0), q.stride(1), w.stride(0), out.stride(0),
        idx.stride(0), num_heads, idx.shape[1], addr.num_slots, addr.block_size,
        addr.stride_block, addr.stride_token, addr.scale_stride, addr.scale_offset,
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=width, D_P2=d_p2, TILE_H=max(16, triton.next_power_of_2(num_heads)),
        KIND=addr.kind, SF=addr.sf, GS=addr.group, FLAT=_flat(addr, width, d_p2),
        HW=not interpret,
    )  # fmt: skip
    if legacy:
        tile_n = tile_n or (32 if d_p2 <= 128 else 16)
        grid = (num_rows, triton.cdiv(idx.shape[1], tile_n))
        _k.index_scores_kernel[grid](*args, TILE_N=tile_n, **consts, num_warps=num_warps or 4)
        return out
    tile_n = tile_n or (128 if d_p2 <= 128 else 64)
    grid = (num_rows, triton.cdiv(idx.shape[1], tile_n * tiles))
    _k.index_scores_tc_kernel[grid](
        *args, TILE_N=tile_n, TILES=tiles, **consts,
        DOT_BF16=index_q.dtype == torch.bfloat16 and addr.kind != _k.KIND_FP32 and not interpret,
        num_warps=num_warps or 4,
    )  # fmt: skip
    return out


def topk_columns(scores: torch.Tensor, count: torch.Tensor, top_k: int) -> torch.Tensor:
    """int32 ``[T, top_k]``: the columns of the ``min(top_k, count[t])`` best scores of each
    row (``torch.topk``), best first, ``-1`` after them; columns ``>= count[t]`` never win."""
    num_rows, width = scores.shape
    out = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=scores.device)
    if width == 0 or num_rows == 0:
        return out
    col = torch.arange(width, device=scores.device)[None, :]
    scores = scores.masked_fill(col >= count.long()[:, None], float("-inf"))
    k = min(top_k, width)
    picked = scores.topk(k, dim=-1).indices
    keep = torch.arange(k, device=scores.device)[None, :] < count.long()[:, None]
    out[:, :k] = torch.where(keep, picked, -1).to(torch.int32)
    return out


def gather_rows(source: KeySource, slots: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*slots.shape, D]``: the (dequantized) row of each slot, zeros for ``-1``."""
    cache, layout = source.cache, source.layout
    flat = slots.reshape(-1).long()
    live = flat >= 0
    s = flat.clamp(min=0)
    width = layout.elements if layout is not None else cache.shape[-1]
    if flat.numel() == 0:
        return torch.zeros(*slots.shape, width, dtype=torch.float32, device=cache.device)
    if layout is not None and layout.is_quantized:
        views = split_kv_cache(cache, layout)
        bs = cache.shape[1]
        v = views.values.view(torch.uint8)[s // bs, s % bs]
        sc = views.scales.view(torch.uint8)[s // bs, s % bs]
        rows = quant.dequantize(v, sc, layout).float()
    elif cache.dim() == 2:
        rows = cache[s].float()
    else:
        rows = (
            cache.reshape(-1, cache.shape[-1])[s].float()
            if cache.is_contiguous()
            else (cache[s // cache.shape[1], s % cache.shape[1], 0].float())
        )
    rows = rows.masked_fill(~live[:, None], 0.0)
    return rows.view(*slots.shape, rows.shape[-1])


def sparse_attention_torch(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path (fp32 math, rows gathered by :func:`gather_rows`)."""
    _check(q, sources, sinks, check)
    out = _out(q, out)
    sink = sinks.float().view(1, -1, 1)  # [1, H, 1]
    for lo in range(0, q.shape[0], _ROWS_PER_CHUNK):
        hi = min(lo + _ROWS_PER_CHUNK, q.shape[0])
        idx = torch.cat([src.index[lo:hi] for src in sources], dim=1)  # [t, K]
        kv = torch.cat([gather_rows(src, src.index[lo:hi]) for src in sources], dim=1)
        logits = torch.einsum("thd,tkd->thk", q[lo:hi].float(), kv) * scale
        logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink).clamp(min=-1e30)
        p = torch.exp(logits - m)
        denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
        o = torch.einsum("thk,tkd->thd", p, kv) / denom.clamp(min=1e-30)
        out[lo:hi] = o.to(q.dtype)
    return out


def sparse_attention_ref(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-row, per-head loop in float64 over the visible rows (tests only)."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(num_rows):
        rows = [gather_rows(src, src.index[t][src.index[t] >= 0]) for src in sources]
        kv = torch.cat(rows).double().cpu()  # [n, D]
        for h in range(num_heads):
            logits = (kv @ q[t, h].double().cpu()) * scale
            sink = float(sinks[h])
            m = max([sink, *logits.tolist()])
            w = torch.exp(logits - m)
            out[t, h] = (w @ kv) / (
                w.sum() + torch.exp(torch.tensor(sink - m, dtype=torch.float64))
            )
    return out
