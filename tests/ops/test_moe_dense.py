"""Batched MoE ops: routing, SwiGLU and the weighted expert sum; Triton == torch (interpreter
on CPU), torch == independent loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvplan.ops.moe_dense import (
    expert_weighted_sum,
    expert_weighted_sum_torch,
    expert_weighted_sum_triton,
    moe_route,
    moe_route_torch,
    moe_route_triton,
    moe_swiglu_torch,
    moe_swiglu_triton,
    swiglu_torch,
    swiglu_triton,
)

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16_TOL = dict(atol=2e-2, rtol=1.6e-2)  # bf16 intermediates; GPU sums in their own order


def _tol(dtype):
    return dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else BF16_TOL


def _router_case(seed, t, e, k, dtype, hashed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=gen) * 4).to(dtype)  # reaches softplus' threshold
    logits[0, 0] = 25.0
    kw = {}
    if hashed:
        table = torch.rand(11, e, generator=gen).argsort(-1)[:, :k]
        table[3, :] = table[3, 0]  # a row naming one expert k times
        kw["tid2eid"] = table
        kw["input_ids"] = torch.randint(0, 11, (t,), generator=gen)
        kw["input_ids"][0] = 3
    else:
        kw["bias"] = 0.1 * torch.randn(e, generator=gen)
    return logits, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sigmoid", [True, False], ids=["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("hashed, e, k", [(False, 6, 2), (False, 16, 3), (True, 5, 2)])
def test_route_triton_matches_torch(hashed, e, k, sigmoid, dtype):
    logits, kw = _router_case(e + k, 9, e, k, dtype, hashed)
    args = dict(top_k=k, sigmoid=sigmoid, scaling=2.5, **kw)
    ids, w, dense = moe_route_torch(logits, **args)
    dev = {n: v.to(TRITON_DEVICE) for n, v in kw.items()}
    g_ids, g_w, g_dense = moe_route_triton(logits.to(TRITON_DEVICE), **{**args, **dev})
    order, g_order = ids.sort(-1), g_ids.cpu().sort(-1)
    assert torch.equal(g_order.values, order.values)  # the same expert sets
    torch.testing.assert_close(
        g_w.cpu().gather(1, g_order.indices), w.gather(1, order.indices), **_tol(dtype)
    )
    torch.testing.assert_close(g_dense.cpu(), dense, **_tol(dtype))
    # independent: each row's dense weights sum to `scaling`, zero off the routed experts
    torch.testing.assert_close(dense.sum(-1), torch.full((9,), 2.5), **_tol(dtype))
    assert (dense[torch.ones_like(dense, dtype=torch.bool).scatter(1, ids, False)] == 0).all()


@pytest.mark.parametrize("hashed", [False, True], ids=["topk", "hash"])
def test_route_triton_reads_strided_logits(hashed):
    """Logits as a column slice of a wider GEMM output (the fused MoE weight's router
    columns): the kernel reads them in place, equal to the contiguous copy."""
    logits, kw = _router_case(7, 5, 6, 2, torch.bfloat16, hashed)
    wide = torch.randn(5, 40, dtype=torch.bfloat16)
    wide[:, 30:36] = logits
    view = wide.to(TRITON_DEVICE)[:, 30:36]
    assert view.stride() == (40, 1)
    dev = {n: v.to(TRITON_DEVICE) for n, v in kw.items()}
    args = dict(top_k=2, sigmoid=False, scaling=1.5, **dev)
    got = moe_route_triton(view, **args)
    want = moe_route_triton(view.contiguous(), **args)
    ref = moe_route_torch(logits, top_k=2, sigmoid=False, scaling=1.5, **kw)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got[0].cpu().sort(-1).values, ref[0].sort(-1).values)
    torch.testing.assert_close(got[2].cpu(), ref[2], **BF16_TOL)


def test_route_matches_loop_reference():
    logits, kw = _router_case(1, 4, 6, 2, torch.float32, hashed=False)
    ids, w, _ = moe_route(logits, top_k=2, sigmoid=False, scaling=1.5, **kw)
    for row in range(4):
        scores = [float(F.softplus(v).sqrt()) for v in logits[row]]
        biased = [s + float(b) for s, b in zip(scores, kw["bias"])]
        top = sorted(range(6), key=lambda i: -biased[i])[:2]
        assert sorted(ids[row].tolist()) == sorted(top)
        total = sum(scores[i] for i in top)
        for slot, eid in enumerate(ids[row].tolist()):
            assert abs(float(w[row, slot]) - scores[eid] / total * 1.5) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_triton_matches_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    t, e, inter, limit = 5, 3, 24, 2.0
    gu = (torch.randn(t, e * 2 * inter, generator=gen) * 3).to(dtype)
    want = moe_swiglu_torch(gu, e, limit)
    g, u = gu.view(t, e, 2, inter).unbind(2)
    for ex in range(e):  # the per-expert formula
        torch.testing.assert_close(want[ex], swiglu_torch(g[:, ex], u[:, ex], limit))
    got = moe_swiglu_triton(gu.to(TRITON_DEVICE), e, limit)
    assert got.shape == (e, t, inter) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))
    pair = swiglu_triton(g[:, 1].to(TRITON_DEVICE), u[:, 1].to(TRITON_DEVICE), limit)
    torch.testing.assert_close(pair.cpu(), want[1], **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_add", [False, True], ids=["plain", "add"])
def test_weighted_sum_triton_matches_torch(with_add, dtype):
    gen = torch.Generator().manual_seed(1)
    e, t, hidden = 4, 6, 150
    y = torch.randn(e, t, hidden, generator=gen).to(dtype)
    dense = torch.rand(t, e, generator=gen) * (torch.rand(t, e, generator=gen) < 0.5)
    add = torch.randn(t, hidden, generator=gen).to(dtype) if with_add else None
    want = expert_weighted_sum_torch(y, dense, add)
    loop = sum(y[i].double() * dense[:, i, None].double() for i in range(e))
    loop = loop + (add.double() if with_add else 0)
    torch.testing.assert_close(want.double(), loop, **_tol(dtype))
    dev = [v.to(TRITON_DEVICE) if v is not None else None for v in (y, dense, add)]
    got = expert_weighted_sum_triton(*dev)
    assert got.dtype == dtype and got.shape == (t, hidden)
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))


def test_errors():
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, top_k=5, sigmoid=True, scaling=1.0, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="exactly one"):
        moe_route(logits, top_k=2, sigmoid=True, scaling=1.0)
    with pytest.raises(ValueError, match="tid2eid"):
        moe_route(logits, top_k=2, sigmoid=True, scaling=1.0,
                  tid2eid=torch.zeros(5, 3, dtype=torch.int64),
                  input_ids=torch.zeros(3, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="dense"):
        expert_weighted_sum(torch.randn(2, 3, 4), torch.rand(3, 3))
