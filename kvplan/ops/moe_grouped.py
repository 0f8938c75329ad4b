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

The Triton path groups the pairs in three launches (`group_pairs_triton`: per-chunk expert
counts, a running count per expert over the chunks, then each pair's rank in its chunk by a
one-hot prefix count and the scatters), which also puts the routing weights in sorted order.
`group_pairs` is the torch form of the same tensors (a one-hot prefix count while ``T*k * E <=
COUNT_SORT_MAX_CELLS``, a stable radix sort above), used by the torch path and as the
reference. The GEMM launches follow a `GroupedPlan` (`grouped_plan` picks one of `PLANS`;
``plan=`` overrides it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import pow2_floor, triton_cdiv, triton_next_pow2
from kvplan.ops.moe_dense import swiglu_torch

__all__ = [
    "GemmTiles",
    "GroupedPlan",
    "PLANS",
    "PairGroups",
    "group_pairs",
    "group_pairs_triton",
    "grouped_down",
    "grouped_gate_up",
    "grouped_plan",
    "moe_grouped",
    "moe_grouped_torch",
    "moe_grouped_triton",
]

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


COUNT_SORT_MAX_CELLS = 1 << 12
"""Most ``T*k * E`` cells for which `group_pairs` ranks pairs by a one-hot prefix count (else
a stable radix sort); both give the same order. Decode batches only: on the H200 the prefix
count took about 5x the sort's time at 8,192 tokens x top-2 of 16, while the 32-token MoE block
with it ran 94.8 us (98.96 with the sort, the same bench an hour earlier)."""


def _sorted_positions(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position int64 ``[n]`` of each pair in the stable by-expert order, offsets int64
    ``[E + 1]``) of the expert ids ``flat`` (int64 ``[n]``)."""
    n, dev = flat.shape[0], flat.device
    if 0 < n * num_experts <= COUNT_SORT_MAX_CELLS:  # counting sort: rank = earlier pairs of e
        hit = flat[:, None] == torch.arange(num_experts, device=dev)  # [n, E]
        cum = hit.to(torch.int32).cumsum(0, dtype=torch.int32)  # [n, E]
        counts = cum[-1].long()
        rank = cum.gather(1, flat[:, None]).squeeze(1).long() - 1  # [n]
        offsets = F.pad(counts.cumsum(0), (1, 0))
        return offsets[flat] + rank, offsets
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts + 1, device=dev, dtype=torch.int64)
    offsets = torch.searchsorted(sorted_ids, experts)  # [E + 1]; offsets[E] == n
    return torch.empty_like(order).scatter_(0, order, torch.arange(n, device=dev)), offsets


def _check_grouping(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[int, int, int, int]:
    """(T, k, E, T*k) of valid `group_pairs` arguments."""
    check_tensor("ids", ids, dtype=torch.int64, ndim=2)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    t, k = ids.shape
    return t, k, num_experts, t * k


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> PairGroups:
    """Sort the pairs of ``ids`` (int64 ``[T, k]``, values in ``[0, E)``) by expert and cut
    them into M tiles of ``block_m`` (a positive int); device ops only, no host sync, no sort
    kernel for ``T*k * E`` up to ``COUNT_SORT_MAX_CELLS`` and ``k <= 16``."""
    t, k, _, n = _check_grouping(ids, num_experts, block_m)
    dev = ids.device
    pos, offsets = _sorted_positions(ids.reshape(-1), num_experts)  # [T*k], [E + 1]
    order = torch.empty_like(pos).scatter_(0, pos, torch.arange(n, device=dev))
    pos_tk = pos.view(t, k)
    if k == 1:
        token_pos = pos_tk
    elif k <= 16:  # slot j goes to the rank of its position among the token's k
        below = (pos_tk[:, None, :] < pos_tk[:, :, None]).sum(2)  # [T, k]
        token_pos = torch.empty_like(pos_tk).scatter_(1, below, pos_tk)
    else:
        token_pos = pos_tk.sort(dim=1).values
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
        token_pos=token_pos.to(torch.int32),
        tile_expert=ex.to(torch.int32),
        tile_start=torch.where(used, start, zero).to(torch.int32),
        tile_end=torch.where(used, end, zero).to(torch.int32),
    )


GROUP_CHUNK_CELLS = 4096
"""Most one-hot cells (``tokens * next_pow2(k) * next_pow2(E)``) a chunk of `group_pairs_triton`
holds in registers."""


def group_pairs_triton(
    ids: torch.Tensor, num_experts: int, block_m: int, weights: torch.Tensor | None = None
) -> tuple[PairGroups, torch.Tensor | None]:
    """`group_pairs` in three Triton launches (plus one memset), and ``weights`` (``[T, k]``,
    optional) in sorted order; the same tensors as the torch path, bit for bit.

    The ids must lie in ``[0, E)`` (not checked on the device: a pair of another value is
    counted nowhere and leaves its sorted slot unwritten)."""
    from kvplan.ops._moe_grouped_kernels import (
        group_count_kernel,
        group_place_kernel,
        group_scan_kernel,
    )

    t, k, e, n = _check_grouping(ids, num_experts, block_m)
    dev = ids.device
    if weights is not None:
        check_tensor("weights", weights, dtype=_FLOATS, shape=ids.shape, device=dev)
        weights = weights.contiguous()
    ids = ids.contiguous()
    k_p2, e_p2 = triton_next_pow2(k), triton_next_pow2(num_experts)
    tok = max(1, min(triton_next_pow2(max(t, 1)), pow2_floor(GROUP_CHUNK_CELLS // (k_p2 * e_p2))))
    chunks = triton_cdiv(t, tok)
    num_tiles = n // block_m + min(num_experts, n)
    i32 = dict(dtype=torch.int32, device=dev)
    counts = torch.empty(max(chunks, 1), e_p2, **i32)
    totals = torch.zeros(e_p2, **i32)
    base = torch.empty_like(counts)
    order = torch.empty(n, dtype=torch.int64, device=dev)
    rows = torch.empty(n, **i32)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    token_pos = torch.empty(t, k, **i32)
    tile_expert, tile_start, tile_end = (torch.empty(num_tiles, **i32) for _ in range(3))
    w_sorted = None if weights is None else torch.empty(n, dtype=weights.dtype, device=dev)
    shape = dict(K=k, K_P2=k_p2, TOK=tok, E_P2=e_p2)
    if chunks:
        group_count_kernel[(chunks,)](ids, counts, totals, t, **shape)
    eb = min(e_p2, 32)
    group_scan_kernel[(e_p2 // eb + 1,)](
        counts, totals, base, offsets, tile_expert, tile_start, tile_end, chunks, num_experts,
        n, num_tiles, block_m, E_P2=e_p2, EB=eb, CB=max(1, 4096 // eb),
        TB=max(1, 4096 // e_p2),
    )  # fmt: skip
    if chunks:
        group_place_kernel[(chunks,)](
            ids, weights if weights is not None else ids, base, order, rows, token_pos,
            w_sorted if w_sorted is not None else order, t, HAS_W=weights is not None, **shape,
        )  # fmt: skip
    groups = PairGroups(rows, order, offsets, token_pos, tile_expert, tile_start, tile_end)
    return groups, w_sorted


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


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemmTiles:
    """Launch shape of one grouped GEMM kernel: ``block_n`` output columns (per half for the
    gate/up kernel) and ``block_k`` reduction columns per step (powers of two), ``num_warps``
    in 1..16 (a power of two), ``num_stages`` >= 1 loads in flight, ``n_major``: the column
    tiles of one M tile are adjacent programs."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    n_major: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            if not _pow2(getattr(self, name)) or getattr(self, name) > 256:
                raise ValueError(f"{name} must be a power of two <= 256, got {getattr(self, name)}")
        if self.num_warps > 16:
            raise ValueError(f"num_warps must be <= 16, got {self.num_warps}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int):
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


@dataclass(frozen=True)
class GroupedPlan:
    """Launch plan of the two grouped GEMMs: ``block_m`` sorted pairs per M tile (a power of
    two) and each kernel's `GemmTiles`. Every plan computes the same products, accumulated in
    fp32; only the order of the fp32 additions over ``K`` differs."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    def __post_init__(self) -> None:
        if not _pow2(self.block_m) or self.block_m > 256:
            raise ValueError(f"block_m must be a power of two <= 256, got {self.block_m}")
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), GemmTiles):
                raise TypeError(f"{name} must be a GemmTiles, got {type(getattr(self, name))}")


PREFILL_MIN_PAIRS_PER_EXPERT = 128
"""Fewest mean pairs per expert (``ceil(T*k / E)``) for which half-precision inputs take
``PLANS["prefill"]``."""

PLANS: dict[str, GroupedPlan] = {
    # interpreter: small tiles; fp32 / few pairs: M near the mean pairs per expert (set by
    # `grouped_plan`), loads not pipelined
    "interpret": GroupedPlan(16, GemmTiles(16, 32, 4, 1), GemmTiles(16, 32, 4, 1)),
    "fp32": GroupedPlan(64, GemmTiles(64, 32, 4, 1), GemmTiles(64, 32, 4, 1)),
    "half": GroupedPlan(64, GemmTiles(64, 64, 4, 1), GemmTiles(64, 64, 4, 1)),
    # half precision, many pairs per expert: wide tiles, pipelined loads, M tiles N-major
    # (the fastest of `bench_dsv4_blocks.py --moe-sweep` at 8,192 tokens on the H200)
    "prefill": GroupedPlan(128, GemmTiles(128, 64, 8, 3, True), GemmTiles(256, 64, 8, 3, True)),
}
"""Launch plans by regime (`grouped_plan` picks one); ``bench/bench_dsv4_blocks.py --moe-sweep``
times alternatives."""


def grouped_plan(num_pairs: int, num_experts: int, dtype: torch.dtype) -> GroupedPlan:
    """The `PLANS` entry for ``num_pairs`` (``T*k``) pairs over ``num_experts`` experts in
    ``dtype``; below the prefill regime ``block_m`` is the mean pairs per expert rounded up
    to a power of two, clamped to 16..64."""
    if triton_interpreting():
        return PLANS["interpret"]
    mean = triton_cdiv(num_pairs, num_experts)
    if dtype != torch.float32 and mean >= PREFILL_MIN_PAIRS_PER_EXPERT:
        return PLANS["prefill"]
    plan = PLANS["fp32" if dtype == torch.float32 else "half"]
    return replace(plan, block_m=max(16, min(64, triton_next_pow2(mean))))


def _launch(kernel, grid_n: int, k_size: int, n_size: int, num_tiles: int, plan, tiles, x):
    """Grid, the shape constexprs and the launch options shared by both GEMM kernels."""
    n_major = tiles.n_major and num_tiles <= 65535  # grid axis 1 limit
    grid = (grid_n, num_tiles) if n_major else (num_tiles, grid_n)
    interp_half = triton_interpreting() and x.dtype != torch.float32
    return kernel[grid], dict(
        BLOCK_M=plan.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        K_TILES=triton_cdiv(k_size, tiles.block_k), EVEN_K=k_size % tiles.block_k == 0,
        EVEN_N=n_size % tiles.block_n == 0, N_MAJOR=n_major,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32: unused for halves
        UPCAST=interp_half, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip


def grouped_gate_up(
    x: torch.Tensor, gate_up: torch.Tensor, groups: PairGroups, limit: float, plan: GroupedPlan
) -> torch.Tensor:
    """``h [T*k, I]`` in ``x``'s dtype: the SwiGLU of each sorted pair's gate/up projection
    (``x [T, H]`` unit column stride, ``gate_up [E, 2I, H]`` contiguous, ``groups`` cut with
    ``plan.block_m``)."""
    from kvplan.ops._moe_grouped_kernels import grouped_gate_up_kernel

    hidden, inter = x.shape[1], gate_up.shape[1] // 2
    h = torch.empty(groups.rows.shape[0], inter, dtype=x.dtype, device=x.device)
    num_tiles = groups.tile_start.shape[0]
    tiles = plan.gate_up
    launch, kw = _launch(grouped_gate_up_kernel, triton_cdiv(inter, tiles.block_n), hidden,
                         inter, num_tiles, plan, tiles, x)  # fmt: skip
    launch(x, gate_up, groups.rows, groups.tile_expert, groups.tile_start, groups.tile_end, h,
           hidden, inter, float(limit), x.stride(0), **kw)  # fmt: skip
    return h


def grouped_down(
    h: torch.Tensor, down: torch.Tensor, w_sorted: torch.Tensor, groups: PairGroups,
    plan: GroupedPlan,
) -> torch.Tensor:  # fmt: skip
    """``c [T*k, H]`` in ``h``'s dtype: ``round(round(h[p] @ down[e]^T) * w_sorted[p])`` per
    sorted pair (``h [T*k, I]`` and ``down [E, H, I]`` contiguous, ``w_sorted [T*k]``)."""
    from kvplan.ops._moe_grouped_kernels import grouped_down_kernel

    hidden, inter = down.shape[1], down.shape[2]
    c = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=h.device)
    num_tiles = groups.tile_start.shape[0]
    tiles = plan.down
    launch, kw = _launch(grouped_down_kernel, triton_cdiv(hidden, tiles.block_n), inter, hidden,
                         num_tiles, plan, tiles, h)  # fmt: skip
    launch(h, down, w_sorted, groups.tile_expert, groups.tile_start, groups.tile_end, c,
           hidden, inter, **kw)  # fmt: skip
    return c


def moe_grouped_triton(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, limit: float, add: torch.Tensor | None = None, *,
    plan: GroupedPlan | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton path of `moe_grouped`: the device-side grouping, then three kernels; ``plan``
    (default `grouped_plan`) sets the GEMM launches."""
    from kvplan.ops._moe_grouped_kernels import grouped_combine_kernel

    t, hidden, e, inter = _check(x, ids, weights, gate_up, down, add)
    k = ids.shape[1]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    plan = grouped_plan(t * k, e, x.dtype) if plan is None else plan
    if not isinstance(plan, GroupedPlan):
        raise TypeError(f"plan must be a GroupedPlan, got {type(plan)}")
    groups, w_sorted = group_pairs_triton(ids, e, plan.block_m, weights)
    x = x if x.stride(1) == 1 else x.contiguous()
    h = grouped_gate_up(x, gate_up.contiguous(), groups, limit, plan)
    c = grouped_down(h, down.contiguous(), w_sorted, groups, plan)
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
