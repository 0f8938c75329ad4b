"""Triton kernels of the batched (dense) MoE path (launched by `kvplan.ops.moe_dense`).

Each kernel repeats the torch path's rounding steps: values are widened to fp32 and every
intermediate that torch materializes in the activation dtype is rounded back to it.

- ``moe_route_kernel``: grid ``(T,)``; scores of one token's router logits, its top-k (or hash
  table) experts, their renormalised weights and the dense ``[E]`` row of summed weights.
- ``swiglu_kernel``: grid ``(T, E, cdiv(I, TILE_I))``;
  ``out = round(round(silu(min(gate, limit))) * clamp(up, -limit, limit))``.
- ``expert_sum_kernel``: grid ``(T, cdiv(H, TILE_H))``;
  ``out = round(round(sum_e dense[t, e] * y[e, t]) (+ add[t]))``, experts in order, fp32.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit
from kvplan.ops._triton_util import round_to as _round


@jit
def _log1p(x):
    """Accurate ``log(1 + x)`` for ``x >= 0`` (the ``u - 1`` correction trick)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@jit
def moe_route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, ids_ptr, w_ptr, dense_ptr,
    num_experts, stride_t, scaling,
    TOP_K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, SIGMOID: tl.constexpr,
    HASH: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = logits_ptr.dtype.element_ty
    e = tl.arange(0, E_P)
    emask = e < num_experts
    logit = tl.load(logits_ptr + t * stride_t + e, mask=emask, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = _round(tl.sigmoid(logit), dtype)
    else:  # sqrt(softplus), softplus with torch's threshold 20
        soft = tl.where(logit > 20.0, logit, _log1p(tl.exp(tl.minimum(logit, 20.0))))
        scores = _round(tl.sqrt(_round(soft, dtype)), dtype)
    kk = tl.arange(0, K_P)
    kmask = kk < TOP_K
    if HASH:
        tok = tl.load(input_ids_ptr + t)
        ids = tl.load(tid2eid_ptr + tok * TOP_K + kk, mask=kmask, other=-1).to(tl.int64)
    else:
        biased = scores + tl.load(bias_ptr + e, mask=emask, other=0.0)
        biased = tl.where(emask, biased, float("-inf"))
        ids = tl.full([K_P], -1, tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(biased, axis=0).to(tl.int64)
            ids = tl.where(kk == j, best, ids)
            biased = tl.where(e == best, float("-inf"), biased)
    hit = ids[:, None] == e[None, :]  # [K_P, E_P]
    w = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)  # gathered, exact
    total = _round(tl.sum(w, axis=0), dtype)
    den = _round(total + 1e-20, dtype)
    w = _round(_round(w / den, dtype) * scaling, dtype)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kmask)
    tl.store(w_ptr + t * TOP_K + kk, w.to(dtype), mask=kmask)
    dense = tl.sum(tl.where(hit, w[:, None], 0.0), axis=0)  # [E_P], repeated experts summed
    tl.store(dense_ptr + t * num_experts + e, dense, mask=emask)


@jit
def swiglu_kernel(
    g_ptr, u_ptr, out_ptr, inter, limit,
    stride_gt, stride_ge, stride_ut, stride_ue, stride_ot, stride_oe,
    TILE_I: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    ex = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * TILE_I + tl.arange(0, TILE_I)
    mask = cols < inter
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_gt + ex * stride_ge + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + t * stride_ut + ex * stride_ue + cols, mask=mask, other=0.0)
    out = swiglu_values(g.to(tl.float32), u.to(tl.float32), limit, dtype)
    tl.store(out_ptr + t * stride_ot + ex * stride_oe + cols, out, mask=mask)


@jit
def swiglu_values(g, u, limit, dtype: tl.constexpr):
    """``round(round(silu(min(g, limit))) * clamp(u, -limit, limit))`` in ``dtype`` for fp32
    ``g`` / ``u`` holding ``dtype`` values (torch's rounding steps; shared by every kernel
    that forms a SwiGLU, so they agree bit for bit)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    return (act * u).to(dtype)


@jit
def expert_sum_kernel(
    y_ptr, dense_ptr, add_ptr, out_ptr, num_rows, num_experts, hidden,
    HAS_ADD: tl.constexpr, TILE_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * TILE_H + tl.arange(0, TILE_H)
    mask = hs < hidden
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros([TILE_H], dtype=tl.float32)
    ex = 0  # a while loop: the CPU interpreter takes no runtime ``range`` bound
    while ex < num_experts:
        wt = tl.load(dense_ptr + t * num_experts + ex)
        y = tl.load(y_ptr + (ex * num_rows + t) * hidden + hs, mask=mask, other=0.0)
        acc += wt * y.to(tl.float32)
        ex += 1
    if HAS_ADD:
        add = tl.load(add_ptr + t * hidden + hs, mask=mask, other=0.0).to(tl.float32)
        acc = _round(acc, dtype) + add
    tl.store(out_ptr + t * hidden + hs, acc.to(dtype), mask=mask)
