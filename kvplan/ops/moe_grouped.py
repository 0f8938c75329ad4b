"""Grouped MoE experts: each routed (token, expert) pair runs through its expert only, with no
host sync and shapes fixed by ``T``, ``k`` and ``E`` (CUDA-graph capturable).

::

    order          = stable sort of the T*k pairs by expert      # group_pairs, on the device
    h[p]           = swiglu(x[row[p]] @ gate_up[e(p)]^T)          # one grouped GEMM + SwiGLU
    c[p]           = round(x_dtype, (h[p] @ down[e(p)]^T) * w[p]) # one grouped GEMM
    out[t]         = round(sum_j c[pos[t, j]]) (+ add[t])         # pairs of t in sorted order

``p`` is a position in the sorted order. Pairs of one token are summed in fp32 in ascending
expert order (a hash row naming an expert twice: table order), the order `experts_sparse`
adds them in; in fp32 the two sums are the same sequence of additions. In bf16 / fp16
`experts_sparse` rounds its running sum to the activation dtype after each expert while this
path rounds once, so the two differ by up to one rounding per routed expert. Triton path: CUDA
tensors or ``KVPLAN_FORCE_TRITON=1``; torch path otherwise (a reference that reads the
per-expert offsets on the host).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import triton_cdiv, triton_next_pow2
from kvplan.ops.moe_dense import swiglu_torch

__all__ = ["PairGroups", "group_pairs", "moe_grouped", "moe_grouped_torch", "moe_grouped_triton"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class PairGroups(NamedTuple):
    """The ``T * k`` (token, expert) pairs sorted by expert (stable), on the ids' device.

    ``rows`` int32 ``[T*k]``: token of each sorted position; ``order`` int64 ``[T*k]``: flat
    pair index (``t * k + slot``) of each sorted position; ``offsets`` int64 ``[E + 1]``: expert
    ``e`` owns sorted positions ``[offsets[e], offsets[e+1])``; ``token_pos`` int32 ``[T, k]``:
    each token's sorted positions, ascending; ``tile_expert`` / ``tile_start`` / ``tile_end``
    int32 ``[T*k // block_m + min(E, T*k)]``: M tiles of at most ``block_m`` positions inside
    one expert (unused tiles have ``start == end == 0``).
    """

    rows: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    token_pos: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> PairGroups:
    """Sort the pairs of ``ids`` (int64 ``[T, k]``, values in ``[0, E)``) by expert and cut
    them into M tiles of ``block_m`` (a positive int); device ops only, no host sync."""
    check_tensor("ids", ids, dtype=torch.int64, ndim=2)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    t, k = ids.shape
    n, dev = t * k, ids.device
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts + 1, device=dev, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_ids, experts)  # [E + 1]; offsets[E] == T*k
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=dev))
    token_pos = inverse.view(t, k).sort(dim=1).values.to(torch.int32)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end_cum = tiles.cumsum(0)
    num_tiles = n // block_m + min(num_experts, n)  # sum_e ceil(c_e / B) <= n // B + #used
    idx = torch.arange(num_tiles, device=dev, dtype=torch.int64)
    tile_expert = torch.searchsorted(tile_end_cum, idx, right=True)  # E past the last tile
    used = tile_expert < num_experts
    ex = tile_expert.clamp(max=num_experts - 1)
    first = tile_end_cum[ex] - tiles[ex]
    start = offsets[ex] + (idx - first) * block_m
    end = torch.minimum(start + block_m, offsets[ex + 1])
    zero = torch.zeros_like(start)
    return PairGroups(
        rows=(order // k).to(torch.int32),
        order=order,
        offsets=offsets,
        token_pos=token_pos,
        tile_expert=ex.to(torch.int32),
        tile_start=torch.where(used, start, zero).to(torch.int32),
        tile_end=torch.where(used, end, zero).to(torch.int32),
    )


def _check(x, ids, weights, gate_up, down, add) -> tuple[int, int, int, int]:
    check_tensor("x", x, dtype=_FLOATS, ndim=2)
    t, hidden = x.shape
    check_tensor("ids", ids, dtype=torch.int64, ndim=2, device=x.device)
    if ids.shape[0] != t or ids.shape[1] < 1:
        raise ValueError(f"ids must have shape ({t}, k >= 1), got {tuple(ids.shape)}")
    check_tensor("weights", weights, dtype=_FLOATS, shape=ids.shape, device=x.device)
    check_tensor("gate_up", gate_up, dtype=x.dtype, ndim=3, device=x.device)
    e, two_inter, _ = gate_up.shape
    if two_inter % 2 or gate_up.shape[2] != hidden:
        raise ValueError(f"gate_up must have shape (E, 2I, {hidden}), got {tuple(gate_up.shape)}")
    inter = two_inter // 2
    check_tensor("down", down, dtype=x.dtype, shape=(e, hidden, inter), device=x.device)
    if add is not None:
        check_tensor("add", add, dtype=x.dtype, shape=(t, hidden), device=x.device)
    return t, hidden, e, inter


def moe_grouped_torch(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, limit: float, add: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Torch path of `moe_grouped` (reads the per-expert offsets on the host)."""
    t, hidden, e, _ = _check(x, ids, weights, gate_up, down, add)
    k = ids.shape[1]
    groups = group_pairs(ids, e, 1)
    w_sorted = weights.reshape(-1)[groups.order]
    rows = groups.rows.long()
    c = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    off = groups.offsets.tolist()
    for ex in range(e):
        lo, hi = off[ex], off[ex + 1]
        if lo == hi:
            continue
        gate, up = F.linear(x[rows[lo:hi]], gate_up[ex]).chunk(2, dim=-1)
        y = F.linear(swiglu_torch(gate, up, limit), down[ex])
        c[lo:hi] = (y * w_sorted[lo:hi, None]).to(x.dtype)
    pos = groups.token_pos.long()
    acc = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    for j in range(k):  # one add at a time: the kernel's order
        acc = acc + c[pos[:, j]].float()
    out = acc.to(x.dtype)
    return out if add is None else out + add


def _blocks(n: int, e: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): M near the mean rows per expert, 16..64."""
    if triton_interpreting():
        return 16, 16, 32
    block_m = max(16, min(64, triton_next_pow2(triton_cdiv(n, e))))
    return block_m, 64, 32 if dtype == torch.float32 else 64


def moe_grouped_triton(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, limit: float, add: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton path of `moe_grouped`: the device-side grouping, then three kernels."""
    from kvplan.ops._moe_grouped_kernels import (
        grouped_combine_kernel,
        grouped_down_kernel,
        grouped_gate_up_kernel,
    )

    t, hidden, e, inter = _check(x, ids, weights, gate_up, down, add)
    k = ids.shape[1]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_m, block_n, block_k = _blocks(t * k, e, x.dtype)
    groups = group_pairs(ids, e, block_m)
    w_sorted = weights.reshape(-1)[groups.order].contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: unused for halves
    upcast = triton_interpreting() and x.dtype != torch.float32
    num_tiles = groups.tile_start.shape[0]
    tile_args = (groups.tile_expert, groups.tile_start, groups.tile_end)
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    grouped_gate_up_kernel[(num_tiles, triton_cdiv(inter, block_n))](
        x, gate_up, groups.rows, *tile_args, h, hidden, inter, float(limit), x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    c = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    grouped_down_kernel[(num_tiles, triton_cdiv(hidden, block_n))](
        h, down, w_sorted, *tile_args, c, hidden, inter,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    tile_h = min(triton_next_pow2(hidden), 128 if triton_interpreting() else 512)
    grouped_combine_kernel[(t, triton_cdiv(hidden, tile_h))](
        c, groups.token_pos, out if add is None else add.contiguous(), out, hidden,
        TOP_K=k, HAS_ADD=add is not None, TILE_H=tile_h, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def moe_grouped(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, limit: float, add: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Routed SwiGLU experts over the pairs each expert is routed, summed per token.

    Args:
        x: ``[T, H]`` fp32/bf16/fp16 (unit column stride on the Triton path).
        ids: int64 ``[T, k]`` expert of each pair, in ``[0, E)`` (repeats allowed);
            weights: ``[T, k]`` float routing weights (`kvplan.ops.moe_dense.moe_route`).
        gate_up: ``[E, 2I, H]`` in ``x``'s dtype (rows ``0..I-1`` gate, ``I..2I-1`` up);
            down: ``[E, H, I]``; limit: gate clamped above, up to ``[-limit, limit]``.
        add: optional ``[T, H]`` in ``x``'s dtype, added after the sum is rounded.

    Returns:
        ``[T, H]`` in ``x``'s dtype: ``round(sum_j round(round(expert_{ids[t,j]}(x[t])) *
        weights[t, j])) (+ add[t])``, the pairs of a token summed in fp32 in ascending expert
        order (module docstring).
    """
    fn = moe_grouped_triton if use_triton(x) else moe_grouped_torch
    return fn(x, ids, weights, gate_up, down, limit, add)
