"""``compress_store``: pool the compression windows that close in a step, normalize, rotate,
quantize and store the entries into a paged cache, and write the step's rows into the
compressor-state ring -- one Triton launch (decode) instead of a gather, a dozen torch ops
and a store per series.

Inputs (``K = 2`` for overlapping CSA windows, else 1; ``C`` the entry width)::

    kv, gate        [T, K*C]      the step's per-token projections (kv: fp32 or BF16 model
                                  dtype; gate: fp32 with the position bias included, or,
                                  with ``gate_bias``, the raw projection in fp32 / BF16)
    gate_bias       optional      :class:`GateBias` ``(table [r, K*C] fp32, positions [T]
                                  int64)``: the gate the windows and the ring read is
                                  ``fp32(gate[t]) + table[positions[t] % r]``
    kv_ring,        [ring_rows + 1, K*C] fp32: the state ring (last row: trash row)
      gate_ring
    window_index    [E, R] int    window rows in [ring | step] space (``ring_rows + t`` = step
                                  row t, -1 = before position 0); ``kvplan.plan.compressor_state``
    positions       [E] int64     RoPE position of each entry (``j * r``)
    slots           [E] int32     cache slot of each entry (-1: store nothing)
    store_rows      [T] int64     ring row each step row is written to (trash row: not kept)

Each entry is (the math of DeepSeek-V4's compressor; CSA rows ``0..r-1`` read the "Ca" half
``[:, :C]`` of their row, rows ``r..2r-1`` the "Cb" half ``[:, C:]``; empty rows have
``kv = 0``, ``gate = -inf``)::

    w     = softmax_rows(gate).to(dtype)                  (fp32 softmax over the R rows)
    entry = RMSNorm((kv * w).sum(rows)) * norm_weight     (fp32 norm, result in dtype)
    entry = RoPE(entry, position)                         (trailing 2 * len(inv_freq) channels,
                                                           adjacent pairs, cos/sin in dtype)

(``gate`` here is the biased fp32 gate; the ring keeps it biased, later steps read it from
there) and is stored as ``PagedRows.store`` stores it: exact layouts keep the model dtype's bits (fp32
as BF16 halves), quantized layouts quantize its BF16 rounding (``kvplan.quant``).

Paths: :func:`compress_store_torch` is the torch path (the gather, :func:`pool_windows`,
``store_kv_cache``, ``index_copy_``); :func:`compress_store_triton` the fused kernel
(``kvplan.ops._compress_store_kernels``). The kernel's stored bytes equal ``store_kv_cache``
of its own pooled entry bit for bit; its pooled entry equals the torch one up to fp32
reassociation (and the BF16 roundings that noise can flip); both add ``gate_bias`` in one fp32
rounding, so the rings they write are bit-identical. :func:`fused_compress_enabled`
says which path a model step takes.

Example (one HCA entry ``j = 0``, ``r = 4``, four step rows, nothing in the ring)::

    index = torch.tensor([[8, 9, 10, 11]])       # ring_rows = 8: step rows 0..3
    compress_store(kv, gate, ring_kv, ring_gate, index, torch.tensor([0]),
                   torch.tensor([5], dtype=torch.int32), store_rows, weights, cache, layout,
                   ratio=4, overlap=False,
                   gate_bias=GateBias(position_bias, torch.arange(4)))   # table [4, C] fp32
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kvplan._checks import check_tensor
from kvplan.formats import KVCacheFormat
from kvplan.ops._dispatch import triton_interpreting
from kvplan.ops.cache_geometry import SF_KIND, cache_bytes, flat_groups, triton_next_pow2
from kvplan.ops.rope import NormSpec, norm_rope_torch, rope_cos_sin
from kvplan.ops.store import store_kv_cache


class PoolWeights(NamedTuple):
    """What pooling takes from the model: ``norm_weight`` fp32 ``[C]``, ``eps``, the rotary
    ``inv_freq`` fp32 ``[RD / 2]`` (RD trailing channels rotated) and ``rope_scale``."""

    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor
    rope_scale: float


class GateBias(NamedTuple):
    """The compressor's learned position bias, for the kernel to add to the raw gate:
    ``table`` fp32 ``[r, K*C]`` (row ``p % r`` is the bias of a token at position ``p``) and
    ``positions`` int64 ``[T]``, the absolute position of each step row (floor modulo, as
    torch's ``%``: a negative position wraps into ``[0, r)``)."""

    table: torch.Tensor
    positions: torch.Tensor


def biased_gate(gate: torch.Tensor, gate_bias: GateBias | None) -> torch.Tensor:
    """The gate the windows read: ``gate`` itself without ``gate_bias``, else fp32
    ``[T, K*C]`` ``fp32(gate) + table[positions % r]`` (torch ops, any device)."""
    if gate_bias is None:
        return gate
    table, positions = gate_bias
    return gate.float() + table[positions % table.shape[0]]


def check_gate_bias(gate_bias: GateBias, num_rows: int, ratio: int, kc: int,
                    device: torch.device) -> GateBias:  # fmt: skip
    """``gate_bias`` with both tensors contiguous (copied where not); raises ``TypeError`` /
    ``ValueError`` unless it is a :class:`GateBias` of an fp32 ``table [ratio, kc]`` and
    int64 / int32 ``positions [num_rows]`` on ``device``."""
    if not isinstance(gate_bias, GateBias):
        raise TypeError(f"gate_bias must be a GateBias, got {type(gate_bias).__name__}")
    table, positions = gate_bias
    check_tensor("gate_bias.table", table, shape=(ratio, kc), dtype=torch.float32,
                 device=device)  # fmt: skip
    check_tensor("gate_bias.positions", positions, shape=(num_rows,),
                 dtype=(torch.int64, torch.int32), device=device)  # fmt: skip
    return GateBias(table.contiguous(), positions.contiguous())


def fused_compress_enabled(t: torch.Tensor) -> bool:
    """Whether a model step pools through the fused kernel for tensors on ``t``'s device:
    CUDA by default; the environment variable ``KVPLAN_FUSED_COMPRESS`` = ``"1"`` forces it
    (CPU: the Triton interpreter), ``"0"`` turns it off."""
    flag = os.environ.get("KVPLAN_FUSED_COMPRESS", "")
    if flag in ("0", "1"):
        return flag == "1"
    return t.is_cuda


def gather_windows(kv, gate, kv_ring, gate_ring, window_index, ratio: int, overlap: bool):
    """``(wkv, wgate)``: the windows ``[E, R, C]`` of ``window_index`` from ``[ring | step]``
    rows (``wkv`` in ``kv``'s dtype, ``wgate`` in ``gate``'s; empty rows 0 / -inf; CSA: the
    "Ca" half for rows ``< r``, the "Cb" half after)."""
    ring_rows = kv_ring.shape[0] - 1
    idx = window_index.long()  # [E, R]
    in_ring = (idx < ring_rows)[..., None]
    ring_idx = idx.clamp(0, ring_rows - 1)
    step_idx = (idx - ring_rows).clamp(0, max(kv.shape[0] - 1, 0))
    empty = (idx < 0)[..., None]
    wkv = torch.where(in_ring, kv_ring[ring_idx], kv.float()[step_idx])
    wgate = torch.where(in_ring, gate_ring[ring_idx], gate.float()[step_idx])
    wkv = wkv.masked_fill(empty, 0.0)
    wgate = wgate.masked_fill(empty, float("-inf"))
    if overlap:
        width = kv.shape[1] // 2
        wkv = torch.cat([wkv[:, :ratio, :width], wkv[:, ratio:, width:]], dim=1)
        wgate = torch.cat([wgate[:, :ratio, :width], wgate[:, ratio:, width:]], dim=1)
    return wkv.to(kv.dtype), wgate.to(gate.dtype)


def pool_windows(kv, gate, positions, weights: PoolWeights) -> torch.Tensor:
    """Entries ``[E, C]`` in ``kv``'s dtype from windows ``kv``/``gate`` ``[E, w, C]`` and
    int64 ``positions [E]`` (module docstring; torch ops, any device)."""
    w = gate.float().softmax(dim=1).to(kv.dtype)  # [E, w, C]
    x = (kv * w).sum(dim=1)
    cos, sin = rope_cos_sin(positions, weights.inv_freq, weights.rope_scale, x.dtype)
    norm = NormSpec(weights.norm_weight.float(), weights.eps)
    return norm_rope_torch(x, cos, sin, norm=norm)


def cache_rows(entries: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """What ``store_kv_cache`` takes for ``entries [E, C]`` (fp32 bits as BF16 halves in an
    exact layout of ``2C`` elements, else the BF16 rounding)."""
    if not layout.is_quantized and layout.elements == 2 * entries.shape[1]:
        return entries.float().contiguous().view(torch.bfloat16)
    return entries.to(torch.bfloat16).contiguous()


def compress_store_torch(kv, gate, kv_ring, gate_ring, window_index, positions, slots,
                         store_rows, weights: PoolWeights, cache, layout: KVCacheFormat, *,
                         ratio: int, overlap: bool,
                         gate_bias: GateBias | None = None) -> torch.Tensor:  # fmt: skip
    """Torch path of :func:`compress_store`; returns the pooled entries ``[E, C]``."""
    gate = biased_gate(gate, gate_bias)
    wkv, wgate = gather_windows(kv, gate, kv_ring, gate_ring, window_index, ratio, overlap)
    if wkv.shape[0]:
        entries = pool_windows(wkv, wgate, positions, weights)
        store_kv_cache(cache_rows(entries, layout), cache, slots, layout=layout, check=False)
    else:
        entries = kv.new_zeros((0, wkv.shape[2]))
    # read before write: this step's rows replace older ones in the ring
    kv_ring.index_copy_(0, store_rows, kv.float())
    gate_ring.index_copy_(0, store_rows, gate.float())
    return entries


def fused_supported(kv: torch.Tensor, layout: KVCacheFormat, weights: PoolWeights) -> bool:
    """Whether the kernel covers this call: fp32 / BF16 ``kv``, a power-of-two width ``C``
    (quantized layouts: ``C`` elements in power-of-two scale groups; exact: the model dtype's
    bits), ``2 * len(inv_freq) <= C``; int8 values and searched scales are not covered."""
    width = weights.norm_weight.shape[0]
    if kv.dtype not in (torch.float32, torch.bfloat16) or width != triton_next_pow2(width):
        return False
    if 2 * weights.inv_freq.shape[0] > width or width < 2:
        return False
    if layout.is_quantized:
        if layout.quantized_dtype == "int8" or layout.scale_search:
            return False
        return layout.elements == width and layout.bf16_elements == 0 and flat_groups(layout)
    per = 2 if kv.dtype == torch.float32 else 1
    return layout.elements == per * width


def compress_store_triton(kv, gate, kv_ring, gate_ring, window_index, positions, slots,
                          store_rows, weights: PoolWeights, cache, layout: KVCacheFormat, *,
                          ratio: int, overlap: bool, state_in_launch: bool = False,
                          pooled_out: torch.Tensor | None = None,
                          gate_bias: GateBias | None = None) -> None:  # fmt: skip
    """Fused path of :func:`compress_store` (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``gate``: fp32 (biased) without ``gate_bias``; with it, the raw fp32 / BF16 projection
    (any row stride), biased in the kernel wherever a step row's gate is read.

    ``state_in_launch``: write the ring in the same launch as the entries (allowed only when
    no window reads a ring row this step writes: decode steps, one row per sequence); else a
    second launch writes it after the entries. ``pooled_out`` (fp32 ``[E, C]``, tests):
    receives every entry before the store's rounding, slots -1 included.
    """
    from kvplan.ops import _compress_store_kernels as k

    width = weights.norm_weight.shape[0]
    num_entries, big_r = window_index.shape
    num_rows = kv.shape[0]
    kc = (2 if overlap else 1) * width
    check_tensor("kv", kv, shape=(num_rows, kc), dtype=(torch.float32, torch.bfloat16))
    gate_dtypes = torch.float32 if gate_bias is None else (torch.float32, torch.bfloat16)
    check_tensor("gate", gate, shape=(num_rows, kc), dtype=gate_dtypes)
    if gate_bias is not None:
        gate_bias = check_gate_bias(gate_bias, num_rows, ratio, kc, kv.device)
    for name, t in (("kv_ring", kv_ring), ("gate_ring", gate_ring)):
        check_tensor(name, t, ndim=2, dtype=torch.float32, contiguous=True)
        if t.shape[1] != kc:
            raise ValueError(f"{name} must have {kc} columns, got {tuple(t.shape)}")
    if big_r != (2 * ratio if overlap else ratio):
        raise ValueError(f"window_index has {big_r} columns; ratio {ratio} needs "
                         f"{2 * ratio if overlap else ratio}")  # fmt: skip
    if not fused_supported(kv, layout, weights):
        raise ValueError(f"the fused kernel does not cover {kv.dtype} rows of width {width} "
                         f"in layout {layout.note!r}")  # fmt: skip
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    raw, geo = cache_bytes(cache, layout)
    interp = triton_interpreting()
    quant = layout.is_quantized
    if quant:
        fmt = k.FMT_QUANT
    else:
        fmt = k.FMT_EXACT_F32 if kv.dtype == torch.float32 else k.FMT_EXACT_BF16
    fp4 = layout.quantized_dtype == "e2m1"
    sf = layout.sf_format
    pooled = pooled_out if pooled_out is not None else weights.norm_weight
    common = dict(
        BLOCK_SIZE=geo.block_size, C=width, R=big_r, RATIO=ratio, OVERLAP=overlap,
        ROW_TILE=min(triton_next_pow2(big_r), 8), NOPE_PAIRS=width // 2 - weights.inv_freq.shape[0],
        BF16=kv.dtype == torch.bfloat16, FMT=fmt,
        GS=layout.elements_per_sf if quant else 2, G=layout.num_scales if quant else 1,
        FP4=fp4, QMAX=6.0 if fp4 else 448.0, SF=SF_KIND[sf] if quant else 0,
        SB=4 if sf == "fp32" else 1, HW=not interp, FAST_DIV=not interp and sf == "fp32",
        EXACT=not interp, WRITE_POOLED=pooled_out is not None, BIAS=gate_bias is not None,
        num_warps=8 if width >= 512 else 4,
    )  # fmt: skip
    # without gate_bias the kernel reads neither pointer: stand-ins of the right kind
    table, step_pos = gate_bias if gate_bias is not None else (kv_ring, store_rows)
    args = (
        kv, gate, kv_ring, gate_ring, window_index.contiguous(), positions, slots, store_rows,
        weights.norm_weight, weights.inv_freq, raw, pooled, table, step_pos,
    )  # fmt: skip
    tail = (kv_ring.shape[0] - 1, kv.stride(0), gate.stride(0), float(weights.eps),
            float(weights.rope_scale), geo.num_slots, geo.block_stride, geo.v_stride,
            geo.s_block_off, geo.s_stride)  # fmt: skip
    if state_in_launch:
        grid = num_entries + num_rows
        if grid:
            k.compress_store_kernel[(grid,)](*args, num_entries, num_rows, *tail, **common)
        return
    if num_entries:
        k.compress_store_kernel[(num_entries,)](*args, num_entries, 0, *tail, **common)
    if num_rows:
        k.compress_store_kernel[(num_rows,)](*args, 0, num_rows, *tail, **common)


def compress_store(kv, gate, kv_ring, gate_ring, window_index, positions, slots, store_rows,
                   weights: PoolWeights, cache, layout: KVCacheFormat, *, ratio: int,
                   overlap: bool, state_in_launch: bool = False,
                   gate_bias: GateBias | None = None) -> None:  # fmt: skip
    """Pool, normalize, rotate, quantize and store the closing entries, then write the
    step's rows into the ring (module docstring). The fused kernel runs where
    :func:`fused_compress_enabled` and :func:`fused_supported` say so, the torch path
    elsewhere."""
    args = (kv, gate, kv_ring, gate_ring, window_index, positions, slots, store_rows,
            weights, cache, layout)  # fmt: skip
    if fused_compress_enabled(kv) and fused_supported(kv, layout, weights):
        compress_store_triton(*args, ratio=ratio, overlap=overlap,
                              state_in_launch=state_in_launch, gate_bias=gate_bias)  # fmt: skip
    else:
        compress_store_torch(*args, ratio=ratio, overlap=overlap, gate_bias=gate_bias)
