"""Manifold-constrained hyper-connection (mHC) ops: the mixing weights, the block input, the
residual update and the final collapse of ``n`` residual streams, in a few kernels each.

With ``s [T, n, hidden]`` the ``n`` residual streams of each token (``K = n * hidden``)::

    f     = RMSNorm_unweighted(s.flatten(1)) @ fn^T     # fp32 [T, (2 + n) * n]
    pre   = sigmoid(f[:, :n] * scale[0] + base[:n]) + hc_eps           # [T, n]
    post  = 2 * sigmoid(f[:, n:2n] * scale[1] + base[n:2n])            # [T, n]
    comb  = softmax_row(f[:, 2n:] * scale[2] + base[2n:]) + hc_eps     # [T, n, n]
    comb  = comb / (column sums + hc_eps), then iters - 1 rounds of
            (rows, then columns) normalised the same way               # Sinkhorn
    x     = sum_i pre[:, i] * s[:, i]                                  # s's dtype   (hc_pre)
    s'[k] = post[k] * out + sum_j comb[j, k] * s[j]                    # s's dtype   (hc_post)

`hc_head` is ``hc_pre``'s ``x`` with ``fn [n, K]``, one scale and ``base [n]`` (no post/comb).

Triton path (CUDA tensors, or ``KVPLAN_FORCE_TRITON=1``): `hc_pre` / `hc_head` are two kernels
(a split-K projection that also sums the squares, then one fused epilogue per token and hidden
tile; above ``PRE_ROW_TILED_MIN_ROWS`` rows three: one weights program per token, then ``x``
by tiles of rows, the same bits), `hc_post` is one (row-tiled above ``ROW_TILED_MIN_ROWS``
rows, the same bits),
and `hc_post_pre` (``hc_post`` then the next block's ``hc_pre``) is two: its projection kernel
forms the tiles of ``s'`` itself. With ``norm=(weight, eps)`` the block input comes back through
the block's RMSNorm (`kvplan.ops.rms_norm.rms_norm_fp32w`); at decode sizes ``hc_pre_kernel``
forms it from the whole row in one program (no separate norm launch; the same arithmetic, the
sum of squares reduced in that program's order). The torch path is the reference; both
compute ``f`` in fp32 (the Triton path applies the RMS scale after the projection, which
differs by fp32 rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import env_count, env_flag, triton_interpreting, use_triton
from kvplan.ops.cache_geometry import triton_cdiv, triton_next_pow2
from kvplan.ops.rms_norm import rms_norm_fp32w_torch, rms_norm_fp32w_triton
from kvplan.ops.split_linear import SplitSums

# a block's input norm passed to the connection: (fp32 weight [hidden], eps)
Norm = tuple[torch.Tensor, float]

__all__ = [
    "hc_head",
    "hc_head_torch",
    "hc_head_triton",
    "hc_post",
    "hc_post_pre",
    "hc_post_pre_torch",
    "hc_post_pre_triton",
    "hc_post_torch",
    "hc_post_triton",
    "hc_pre",
    "hc_pre_torch",
    "hc_pre_triton",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# `hc_post_pre` fuses up to this many tokens; more run `hc_post` then `hc_pre` (the same bits):
# the fused projection recomputes s' per tile. `bench_dsv4_blocks.py --hc-rows 32,64,128,256`
# (H200, 2026-12-02, tensor-core projection, graph replay): unfused vs fused 64 rows 23.8 vs
# 27.6 us, 128 rows 29.6 vs 32.4, 256 rows 28.4 vs 49.5; at 32 rows 18.8 vs 23.3 in that run,
# 19.6 vs 19.4 in another, and the same in the decode step (`bench_hybrid.py
# --hc-fused-max-rows 256,0,256,0`, batch 32: 2.93 / 2.91 vs 2.79 / 2.93 ms)
FUSED_MAX_ROWS = 32
# ``norm`` formed inside ``hc_pre_kernel`` at decode sizes (25 launches fewer a DeepSeek-V4
# step); ``KVPLAN_HC_FUSED_NORM=0`` runs `rms_norm_fp32w` after the connection (A/B runs).
# H100, 2026-12-06, 32K x 32 fp8 decode (`bench/run_s42b.sh`, six off / on pairs): async step
# median 2.865 vs 2.90 ms, graph replays 3.345 vs 3.40 ms; the step's kernels 2,695 us in 311
# launches vs 2,742 in 336 (hc_pre 129.2 vs 125.9 us, the separate norms 57.0 -> 17.2 us).
# The first form ran the program with four warps (`run_s42a.sh`): the Sinkhorn program got
# slower (6.2 vs 5.1 us a launch) and the step no faster.
FUSED_NORM = env_flag("KVPLAN_HC_FUSED_NORM", True)


def _check_pre(s, fn, base, scale, n_out: int, num_scales: int) -> tuple[int, int, int]:
    check_tensor("s", s, dtype=_FLOATS, ndim=3)
    t, n, hidden = s.shape
    rows = n_out * n if n_out > 1 else n  # (2 + n) * n for hc_pre, n for hc_head
    check_tensor("fn", fn, dtype=torch.float32, shape=(rows, n * hidden), device=s.device)
    check_tensor("base", base, dtype=torch.float32, shape=(rows,), device=s.device)
    check_tensor("scale", scale, dtype=torch.float32, shape=(num_scales,), device=s.device)
    return t, n, hidden


def _check_iters(iters: int) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")


# --- torch path (the reference) -------------------------------------------------------------


def _mix_weights(s: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``f = RMSNorm_unweighted(s.flatten(1)) @ fn^T``."""
    sf = s.flatten(1).float()
    sf = sf * torch.rsqrt(sf.square().mean(-1, keepdim=True) + eps)
    return F.linear(sf, fn)


def _check_norm(s: torch.Tensor, norm: Norm | None) -> None:
    """``norm``: None, or ``(weight, eps)`` with an fp32 ``[hidden]`` weight on ``s``'s device
    and a float ``eps``."""
    if norm is None:
        return
    if not (isinstance(norm, tuple) and len(norm) == 2):
        raise TypeError(f"norm must be a (weight, eps) tuple or None, got {type(norm).__name__}")
    weight, norm_eps = norm
    hidden = s.shape[2] if s.dim() == 3 else 0
    check_tensor("norm weight", weight, dtype=torch.float32, shape=(hidden,), device=s.device)
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or norm_eps < 0:
        raise ValueError(f"norm eps must be a float >= 0, got {norm_eps!r}")


def _normed_torch(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    return x if norm is None else rms_norm_fp32w_torch(x, norm[0], norm[1])


def hc_pre_torch(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch path of `hc_pre`."""
    n = s.shape[1] if s.dim() == 3 else 0
    _check_pre(s, fn, base, scale, 2 + n, 3)
    _check_iters(iters)
    _check_norm(s, norm)
    f = _mix_weights(s, fn, eps)
    pre_w, post_w, comb_w = f.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    x = (pre.unsqueeze(-1) * s).sum(dim=1).to(s.dtype)
    return post, comb, _normed_torch(x, norm)


def hc_head_torch(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, hc_eps: float, eps: float, norm: Norm | None = None,
) -> torch.Tensor:  # fmt: skip
    """Torch path of `hc_head`."""
    _check_pre(s, fn, base, scale, 1, 1)
    _check_norm(s, norm)
    f = _mix_weights(s, fn, eps)
    pre = torch.sigmoid(f * scale + base) + hc_eps
    return _normed_torch((pre.unsqueeze(-1) * s).sum(dim=1).to(s.dtype), norm)


def hc_post_torch(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums
) -> torch.Tensor:
    """Torch path of `hc_post`."""
    _check_post(s, post, comb, out)
    out = _total(out)
    dtype = s.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), s)  # [T, n, hidden]
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_post_pre_torch(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums,
    fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch path of `hc_post_pre`: `hc_post_torch`, then `hc_pre_torch` on its result."""
    s = hc_post_torch(s, post, comb, out)
    return (s, *hc_pre_torch(s, fn, base, scale, iters=iters, hc_eps=hc_eps, eps=eps,
                             norm=norm))  # fmt: skip


def _check_post(s, post, comb, out) -> None:
    check_tensor("s", s, dtype=_FLOATS, ndim=3)
    t, n, hidden = s.shape
    check_tensor("post", post, dtype=torch.float32, shape=(t, n), device=s.device)
    check_tensor("comb", comb, dtype=torch.float32, shape=(t, n, n), device=s.device)
    if isinstance(out, SplitSums):
        parts = out.sums.shape[0]
        check_tensor("out.sums", out.sums, shape=(parts, t, hidden), device=s.device)
        if out.dtype != s.dtype:
            raise ValueError(f"out.dtype must be s's dtype {s.dtype}, got {out.dtype}")
    else:
        check_tensor("out", out, dtype=s.dtype, shape=(t, hidden), device=s.device)


def _out_args(out: torch.Tensor | SplitSums) -> tuple[torch.Tensor, int, int]:
    """(tensor, stride between partials, ``OUT_SPLITS``) of a block output as the kernels
    take it: ``out`` itself (0, 0), or a `SplitSums`' partials read in place (rows of
    ``hidden`` contiguous values)."""
    if not isinstance(out, SplitSums):
        return out.contiguous(), 0, 0
    sums = out.sums
    if sums.stride(1) != sums.shape[2]:
        sums = sums.contiguous()
    return sums, sums.stride(0), sums.shape[0]


def _total(out: torch.Tensor | SplitSums) -> torch.Tensor:
    return out.total() if isinstance(out, SplitSums) else out


# --- Triton path ----------------------------------------------------------------------------


def _hidden_tile(hidden: int) -> int:
    return min(triton_next_pow2(hidden), 128 if triton_interpreting() else 512)


class _ProjPlan(NamedTuple):
    """Launch shape of ``hc_proj_kernel``: row tile, hidden columns per stream of a K tile,
    hidden columns per split, number of splits, warps, tensor-core dots (``TC``)."""

    tile_t: int
    tile_h: int
    h_per_split: int
    splits: int
    num_warps: int
    tc: bool = False


# bf16 projections of more rows than this run ``hc_proj_kernel``'s tensor-core form: ``fn``
# split into three bf16 parts, the products exact, fp32 accumulation. Every size: on the H200
# (`bench_dsv4_blocks.py --hc-rows 32,256`, 2026-12-02, hc_pre graph replay) 32 rows 16.1 vs
# 23.6 us for the IEEE fp32 form, 256 rows 22.4 vs 38.9 us, the same max|diff| to the
# reference; 4,096-8,192 rows 2.9-3.0x (session 12).
TC_MIN_ROWS = 0


# programs the projection wants in all (decode sizes up to 256 rows, prefill sizes above).
# Decode: at 256 rows the targets 128 / 256 / 512 / 1,024 took 34.6 / 34.3 / 35.2 / 40.1 us
# (hc_pre, both kernels; `bench/bench_dsv4_blocks.py --rows 256 --proj-programs
# 128,256,512,1024`, H200, 2026-12-02): 256 (at 32 rows the cap of one K tile a program gives
# it the same plan as 1,024). Prefill: 256 and 512 measured the same at 8,192 rows
# (154.4 / 153.9 us), 1,024 and 2,048 slower (`--rows 8192 --proj-programs 256,512,1024,2048`).
PROJ_PROGRAMS = (256, 256)


# ``hc_proj_kernel`` issues each K tile's ``fn`` load first, beside the fused residual
# update's loads and ahead of its barrier (``KVPLAN_HC_FN_FIRST``; 0: after the read back).
# H100, 2026-12-07, profiled 32K x 32 fp8 decode steps (`bench/run_s54e.sh`, alternating):
# hc_proj 147.2 / 145.8 us a step (25 launches) against 151.6 / 152.0. (Projecting the
# stored tile from registers instead of reading it back, session 54 call B: 53 us a launch.)
FN_FIRST = env_flag("KVPLAN_HC_FN_FIRST", True)


def _small_tile_rows() -> int:
    """`SMALL_TILE_ROWS`: ``KVPLAN_HC_SMALL_ROWS`` (A/B runs; 16 gives session 16's plan, 32
    session 17's) or 256."""
    return env_count("KVPLAN_HC_SMALL_ROWS", 256)


# up to this many rows the projection's row tile is 16 (else 32 up to 256 rows, 64 above): at 32 rows
# the 32-row tile of the tensor-core form spills on sm_90 (546 local-memory instructions of
# 6,632 with the residual update fused; none at 16 x 16). H200, DeepSeek-V4-shaped decode at
# 32K, batch 32 (`bench_hybrid.py`, 2026-12-03, session 17 call C): fp8 step 2.66 / 2.69 ms
# async with 16-row tiles vs 2.98 ms with 32-row tiles in the same call. Larger decode batches
# (session 18 call A, same bench, fp8): batch 64 at 32K 3.05 vs 3.07 ms (16 vs 32-row tiles up to
# 256 rows), batch 256 at 128K 8.93 vs 9.32 ms async (graph replays 10.25 vs 11.95 ms).
SMALL_TILE_ROWS = _small_tile_rows()


def _proj_plan(t: int, n: int, hidden: int, dtype: torch.dtype | None = None) -> _ProjPlan:
    """About ``PROJ_PROGRAMS`` programs (split-K, at most one split per K tile); large ``T``:
    a few splits of many K tiles (bf16: on the tensor cores, wider K tiles). The fused and unfused
    paths share this plan (their summation order is the same only when their plans are)."""
    interp = triton_interpreting()
    n_p = triton_next_pow2(n)
    tc = dtype == torch.bfloat16 and t > TC_MIN_ROWS
    tile_t = 16 if t <= max(16, SMALL_TILE_ROWS) else 32 if t <= 256 else 64
    tile_h = max(8, 16 // n_p) if interp else max(16, (128 if tc else 64) // n_p)
    h_tiles = triton_cdiv(hidden, tile_h)  # N_P * tile_h >= 16 (a dot's K)
    target = 4 if interp else PROJ_PROGRAMS[t > 256]  # programs wanted in all
    splits = max(1, min(h_tiles, target // max(1, triton_cdiv(t, tile_t))))
    h_per_split = triton_cdiv(h_tiles, splits) * tile_h
    warps = 4
    return _ProjPlan(tile_t, tile_h, h_per_split, triton_cdiv(hidden, h_per_split), warps, tc)


class RowTile(NamedTuple):
    """Launch shape of a row-tiled kernel (``hc_pre_rows_kernel`` / ``hc_post_rows_kernel``):
    rows and hidden columns per program (powers of two), warps."""

    tile_t: int
    tile_h: int
    num_warps: int


# more rows than this take the row-tiled hc_post kernel (the same bits: the element operations
# are the one-token kernel's)
ROW_TILED_MIN_ROWS = 256
# more rows than this take the row-tiled hc_pre (the per-token weights from ``hc_pre_kernel``'s
# own code, ``x`` by row tiles; both forms add the streams by the same explicit fma sequence,
# so ``x`` has the same bits; on the H200 at 8,192 rows 160.9 vs 283.1 us, measured when the
# rows form still summed differently)
PRE_ROW_TILED_MIN_ROWS = 256
PRE_ROW_TILE = RowTile(8, 512, 8)
POST_ROW_TILE = RowTile(4, 256, 8)


def _row_tile(tile: RowTile, hidden: int) -> RowTile:
    """``tile`` with its hidden width capped at the hidden size."""
    return tile._replace(tile_h=min(tile.tile_h, triton_next_pow2(hidden)))


# Warps of ``hc_pre_kernel``'s decode-size launches (``KVPLAN_HC_PRE_WARPS``; 1, 2, 4 or 8).
# One warp: the fused norm's program holds the 2,048-wide row in 32 threads (~2,550 sm_90
# instructions, ptxas spills up to 64 bytes a thread); at four warps the whole launch is 1,152
# instructions, and the Sinkhorn rounds stay inside each warp (each warp holds the token's
# 4 x 4 matrix; no barrier in the rounds' loop), yet slower: H100, 32K x 32 fp8 decode step
# (`bench/run_s54c.sh`, profiled steps) 154.9 us in 25 launches at four warps against 129.9
# at one (session 42: 6.2 vs 5.1 us a launch); async steps 2.86 / 2.75 / 2.77 against 2.82 /
# 2.75 / 2.87 ms, alternating. A program that forms the weights of 4 tokens at once (their
# Sinkhorn rounds in one tensor) measured 7.8 us a launch at four warps (session 54, call B).
PRE_DECODE_WARPS = env_count("KVPLAN_HC_PRE_WARPS", 1)
if PRE_DECODE_WARPS not in (1, 2, 4, 8):
    raise ValueError(f"KVPLAN_HC_PRE_WARPS must be 1, 2, 4 or 8, got {PRE_DECODE_WARPS}")


def _epilogue_warps(t: int) -> int:
    """Warps of ``hc_pre_kernel``: ``PRE_DECODE_WARPS`` for decode sizes, four for prefill
    (the block-input tiles stream more memory)."""
    return PRE_DECODE_WARPS if t <= 256 else 4


def _project(
    s: torch.Tensor, fn: torch.Tensor, fuse: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-K partials of ``x.flatten(1) @ fn^T`` and of the row sums of squares (``part``
    fp32 ``[splits, T, N_PAD]``, ``sq`` fp32 ``[splits, T]``) and ``x [T, n, hidden]``: ``s``
    itself, or with ``fuse = (post, comb, out)`` the new tensor ``hc_post(s, post, comb, out)``
    written by the same kernel."""
    from kvplan.ops._hyper_connection_kernels import hc_proj_kernel

    t, n, hidden = s.shape
    n_out = fn.shape[0]
    n_pad = max(16, triton_next_pow2(n_out))
    plan = _proj_plan(t, n, hidden, s.dtype)
    part = torch.empty(plan.splits, t, n_pad, dtype=torch.float32, device=s.device)
    sq = torch.empty(plan.splits, t, dtype=torch.float32, device=s.device)
    if fuse is None:
        x, (post, comb), (out, split_stride, out_splits) = s, (s, s), (s, 0, 0)  # unread
    else:
        x, (post, comb), (out, split_stride, out_splits) = (
            torch.empty_like(s), (f.contiguous() for f in fuse[:2]), _out_args(fuse[2])
        )  # fmt: skip
    hc_proj_kernel[(triton_cdiv(t, plan.tile_t), plan.splits)](
        s, out, post, comb, x, fn, part, sq, t, hidden, plan.h_per_split, n_out, split_stride,
        N=n, N_P=triton_next_pow2(n), TILE_T=plan.tile_t, TILE_H=plan.tile_h, N_PAD=n_pad,
        FUSED=fuse is not None, TC=plan.tc, OUT_SPLITS=out_splits, FN_FIRST=FN_FIRST,
        num_warps=plan.num_warps,
    )  # fmt: skip
    return part, sq, x


def _pre_launch(s, fn, base, scale, iters, hc_eps, eps, head: bool, fuse: tuple | None = None,
                norm: Norm | None = None):  # fmt: skip
    """(post, comb, x, s_used): the two kernels of `hc_pre` / `hc_head` on ``s`` or, with
    ``fuse``, on ``s_used = hc_post(s, *fuse)``; with ``norm``, ``x`` is the block input's
    RMSNorm, formed by the second kernel (decode sizes) or by `rms_norm_fp32w_triton` after
    the row-tiled form."""
    from kvplan.ops._hyper_connection_kernels import hc_pre_kernel

    t, n, hidden = s.shape
    s = s.contiguous()
    x = torch.empty(t, hidden, dtype=s.dtype, device=s.device)
    post = torch.empty(t, n, dtype=torch.float32, device=s.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=s.device)
    if t == 0:
        return post, comb, x, torch.empty_like(s)
    part, sq, s = _project(s, fn.contiguous(), fuse)
    splits, n_pad = part.shape[0], part.shape[2]
    rows = t > PRE_ROW_TILED_MIN_ROWS  # one weights program per token, then x by row tiles
    fused_norm = norm is not None and not rows and FUSED_NORM
    # the fused norm takes the whole row in one tile (same warps: a wider Sinkhorn program
    # measured slower, H100 2026-12-06: 6.2 us a launch with 4 warps against 5.1 + 1.6 us for
    # one warp and rms_norm's kernel)
    tile_h = triton_next_pow2(hidden) if fused_norm else _hidden_tile(hidden)
    warps = _epilogue_warps(t)
    pre = torch.empty(t, n, dtype=torch.float32, device=s.device) if rows else post
    grid = (t, 1 if rows else triton_cdiv(hidden, tile_h) + (0 if head else 1))
    norm_w, norm_eps = norm if fused_norm else (base, 0.0)  # base: an unread placeholder
    hc_pre_kernel[grid](
        part, sq, base.contiguous(), scale.contiguous(), s, x, post, comb, pre, norm_w,
        t, hidden, splits, 1.0 / (n * hidden), eps, hc_eps, iters, 1.0 / hidden, norm_eps,
        N=n, N_P=triton_next_pow2(n), N_PAD=n_pad, SPLITS_P=triton_next_pow2(splits),
        TILE_H=tile_h, HEAD=head, WEIGHTS_ONLY=rows, NORM=fused_norm, num_warps=warps,
        enable_fp_fusion=False,
    )  # fmt: skip
    if rows:
        from kvplan.ops._hyper_connection_kernels import hc_pre_rows_kernel

        rt = _row_tile(PRE_ROW_TILE, hidden)
        hc_pre_rows_kernel[(triton_cdiv(t, rt.tile_t), triton_cdiv(hidden, rt.tile_h))](
            pre, s, x, t, hidden, N=n, N_P=triton_next_pow2(n), TILE_T=rt.tile_t,
            TILE_H=rt.tile_h, num_warps=rt.num_warps,
        )  # fmt: skip
    if norm is not None and not fused_norm:
        x = rms_norm_fp32w_triton(x, norm[0], norm[1])
    return post, comb, x, s


def hc_pre_triton(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Triton path of `hc_pre` (two kernels)."""
    n = s.shape[1] if s.dim() == 3 else 0
    _check_pre(s, fn, base, scale, 2 + n, 3)
    _check_iters(iters)
    _check_norm(s, norm)
    return _pre_launch(s, fn, base, scale, iters, hc_eps, eps, head=False, norm=norm)[:3]


def hc_head_triton(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, hc_eps: float, eps: float, norm: Norm | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton path of `hc_head` (two kernels)."""
    _check_pre(s, fn, base, scale, 1, 1)
    _check_norm(s, norm)
    return _pre_launch(s, fn, base, scale, 1, hc_eps, eps, head=True, norm=norm)[2]


def hc_post_triton(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums
) -> torch.Tensor:
    """Triton path of `hc_post` (one kernel)."""
    from kvplan.ops._hyper_connection_kernels import hc_post_kernel

    _check_post(s, post, comb, out)
    t, n, hidden = s.shape
    res = torch.empty(t, n, hidden, dtype=s.dtype, device=s.device)
    if t == 0:
        return res
    if t > ROW_TILED_MIN_ROWS:
        from kvplan.ops._hyper_connection_kernels import hc_post_rows_kernel

        args = (s.contiguous(), _total(out).contiguous(), post.contiguous(), comb.contiguous(),
                res)  # fmt: skip
        rt = _row_tile(POST_ROW_TILE, hidden)
        hc_post_rows_kernel[(triton_cdiv(t, rt.tile_t), triton_cdiv(hidden, rt.tile_h))](
            *args, t, hidden, N=n, N_P=triton_next_pow2(n), TILE_T=rt.tile_t,
            TILE_H=rt.tile_h, num_warps=rt.num_warps,
        )  # fmt: skip
        return res
    out, split_stride, out_splits = _out_args(out)
    tile_h = _hidden_tile(hidden)
    hc_post_kernel[(t, triton_cdiv(hidden, tile_h))](
        s.contiguous(), out, post.contiguous(), comb.contiguous(), res, hidden, split_stride,
        N=n, N_P=triton_next_pow2(n), TILE_H=tile_h, OUT_SPLITS=out_splits, num_warps=4,
    )  # fmt: skip
    return res


def hc_post_pre_triton(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums,
    fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Triton path of `hc_post_pre` (two kernels: the projection writes ``s'``)."""
    _check_post(s, post, comb, out)
    n = s.shape[1]
    _check_pre(s, fn, base, scale, 2 + n, 3)
    _check_iters(iters)
    _check_norm(s, norm)
    post2, comb2, x, s2 = _pre_launch(
        s, fn, base, scale, iters, hc_eps, eps, head=False, fuse=(post, comb, out), norm=norm
    )
    return s2, post2, comb2, x


# --- public entry points --------------------------------------------------------------------


def hc_pre(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The mixing weights of a hyper-connection and its block input (module docstring).

    Args:
        s: ``[T, n, hidden]`` fp32/bf16/fp16, the residual streams.
        fn: fp32 ``[(2 + n) * n, n * hidden]``; base: fp32 ``[(2 + n) * n]``;
            scale: fp32 ``[3]`` (pre, post, comb), all on ``s``'s device.
        iters: Sinkhorn iterations (>= 1); hc_eps: the mixing epsilon; eps: the RMSNorm's.
        norm: ``(weight, eps)``: return the block's input norm of ``x`` instead,
            ``rms_norm_fp32w(x, weight, eps)`` (``weight`` fp32 ``[hidden]``); the Triton
            path forms it in its second kernel for decode sizes (one launch fewer; the sum of
            squares in that kernel's reduction order, so within a last bit of the separate
            kernel's result on a GPU).

    Returns:
        (``post`` fp32 ``[T, n]``, ``comb`` fp32 ``[T, n, n]``, ``x [T, hidden]`` in ``s``'s
        dtype).

    Example::

        post, comb, x = hc_pre(s, hc.fn, hc.base, hc.scale, iters=20, hc_eps=1e-6, eps=1e-6)
        s = hc_post(s, post, comb, block(x))
    """
    fn_ = hc_pre_triton if use_triton(s) else hc_pre_torch
    return fn_(s, fn, base, scale, iters=iters, hc_eps=hc_eps, eps=eps, norm=norm)


def hc_head(
    s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, hc_eps: float, eps: float, norm: Norm | None = None,
) -> torch.Tensor:  # fmt: skip
    """Collapse ``s [T, n, hidden]`` into ``[T, hidden]`` (``s``'s dtype) with
    ``pre = sigmoid(f * scale + base) + hc_eps``, ``f = RMSNorm(s.flatten(1)) @ fn^T``.

    ``fn`` fp32 ``[n, n * hidden]``, ``base`` fp32 ``[n]``, ``scale`` fp32 ``[1]``; ``norm``
    as in `hc_pre` (the final norm of the collapsed row).
    """
    fn_ = hc_head_triton if use_triton(s) else hc_head_torch
    return fn_(s, fn, base, scale, hc_eps=hc_eps, eps=eps, norm=norm)


def hc_post(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums
) -> torch.Tensor:
    """``s'[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * s[t, j]`` in ``s``'s dtype.

    ``s [T, n, hidden]``; ``post`` fp32 ``[T, n]`` and ``comb`` fp32 ``[T, n, n]`` from
    `hc_pre`; ``out [T, hidden]`` (the block's output, ``s``'s dtype), or a `SplitSums` of it
    (``dtype`` ``s``'s: a split-K projection's fp32 partials, which the kernel adds up as
    ``out.total()`` does, with the same bits). ``post`` and ``comb`` are rounded to ``s``'s
    dtype first, and each of the two terms is rounded before the sum (the Triton path for
    fp32 ``s`` adds the ``post`` term with one fused multiply-add). Returns a new
    ``[T, n, hidden]`` tensor.
    """
    fn_ = hc_post_triton if use_triton(s) else hc_post_torch
    return fn_(s, post, comb, out)


def hc_post_pre(
    s: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor | SplitSums,
    fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    *, iters: int, hc_eps: float, eps: float, norm: Norm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`hc_post` of one block, then `hc_pre` of the next block on its result.

    Args:
        s, post, comb, out: as in `hc_post` (``post`` / ``comb`` from this block's `hc_pre`).
        fn, base, scale, iters, hc_eps, eps, norm: the next block's, as in `hc_pre`.

    Returns:
        (``s'`` ``[T, n, hidden]`` in ``s``'s dtype, and the next block's ``post`` fp32
        ``[T, n]``, ``comb`` fp32 ``[T, n, n]``, ``x [T, hidden]``).

    Exactness: the torch path is `hc_post_torch` then `hc_pre_torch`. The Triton path equals
    `hc_post_triton` then `hc_pre_triton` bit for bit: ``s'`` by the same code, and the
    projection reads ``s'`` back from memory in the unfused kernel's tiles and order. More
    than ``FUSED_MAX_ROWS`` tokens run those two ops (prefill sizes, where they are faster).

    Example::

        post, comb, x = hc_pre(s, attn.fn, attn.base, attn.scale, **kw)
        s, post, comb, x = hc_post_pre(s, post, comb, attention(x), ffn.fn, ffn.base,
                                       ffn.scale, **kw)
        s = hc_post(s, post, comb, moe(x))
    """
    kw = dict(iters=iters, hc_eps=hc_eps, eps=eps, norm=norm)
    if not use_triton(s):
        return hc_post_pre_torch(s, post, comb, out, fn, base, scale, **kw)
    if s.dim() == 3 and s.shape[0] > FUSED_MAX_ROWS:  # prefill-sized: two passes are faster
        s = hc_post_triton(s, post, comb, out)
        return (s, *hc_pre_triton(s, fn, base, scale, **kw))
    return hc_post_pre_triton(s, post, comb, out, fn, base, scale, **kw)
