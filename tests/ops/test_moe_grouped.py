"""Grouped MoE experts: the device-side pair grouping, and the grouped op (Triton in the
interpreter on CPU, and its torch path) against `DeepseekV4MoE.experts_sparse`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvplan.models.deepseek_v4.moe import DeepseekV4MoE
from kvplan.ops.moe_grouped import group_pairs, moe_grouped, moe_grouped_torch, moe_grouped_triton

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTER, LIMIT = 24, 20, 1.5  # not powers of two: masked tiles


def _case(seed, t, e, k, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=gen)
    gate_up = torch.randn(e, 2 * INTER, HIDDEN, generator=gen) * 0.4
    down = torch.randn(e, HIDDEN, INTER, generator=gen) * 0.4
    used = max(1, e - 2)  # the last experts get no rows
    ids = torch.rand(t, used, generator=gen).argsort(-1)[:, :k] if k <= used else None
    ids = torch.randint(0, used, (t, k), generator=gen) if ids is None else ids
    if k >= 2:
        ids[0, :] = ids[0, 0]  # a hash row naming one expert k times
    w = torch.rand(t, k, generator=gen) + 0.1
    cast = [v.to(dtype) for v in (x, w, gate_up, down)]
    return cast[0], ids, cast[1], cast[2], cast[3]


def _sparse(x, ids, w, gate_up, down):
    moe = SimpleNamespace(gate_up=gate_up, down=down, limit=LIMIT)
    return DeepseekV4MoE.experts_sparse(moe, x, ids, w)


def _dev(*ts):
    return [v.to(TRITON_DEVICE) for v in ts]


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("e", [4, 16])
def test_grouped_equals_sparse_fp32(e, k, t):
    x, ids, w, gate_up, down = _case(100 * e + 10 * k + t, t, e, k)
    want = _sparse(x, ids, w, gate_up, down)
    assert want.abs().max() > 0.1
    got = moe_grouped_triton(*_dev(x, ids, w, gate_up, down), LIMIT).cpu()
    ref = moe_grouped_torch(x, ids, w, gate_up, down, LIMIT)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(ref, want, atol=2e-6, rtol=2e-5)


def test_grouped_adds_after_rounding_and_a_repeated_expert_counts_twice():
    x, ids, w, gate_up, down = _case(7, 6, 5, 2)
    ids[1] = torch.tensor([2, 2])
    add = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3))
    got = moe_grouped_triton(*_dev(x, ids, w, gate_up, down), LIMIT, add.to(TRITON_DEVICE))
    want = _sparse(x, ids, w, gate_up, down) + add
    torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=2e-5)
    single = _sparse(x[1:2], ids[1:2, :1], w[1:2].sum(1, keepdim=True), gate_up, down)
    torch.testing.assert_close(got.cpu()[1:2] - add[1:2], single, atol=2e-6, rtol=2e-5)
    assert torch.equal(moe_grouped(x, ids, w, gate_up, down, LIMIT, add),
                       moe_grouped_torch(x, ids, w, gate_up, down, LIMIT, add))  # fmt: skip


def _ulps(a, b, scale, dtype):
    """Largest ``|a - b|`` in units of ``dtype``'s ulp at ``scale``."""
    ulp = torch.finfo(dtype).eps * 2.0 ** float(torch.floor(torch.log2(scale)))
    return float((a.double() - b.double()).abs().max()) / ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("e, k, t", [(4, 2, 5), (16, 3, 33), (16, 2, 5)])
def test_grouped_half_precision(e, k, t, dtype):
    x, ids, w, gate_up, down = _case(e + k + t, t, e, k, dtype)
    got = moe_grouped_triton(*_dev(x, ids, w, gate_up, down), LIMIT).cpu()
    ref = moe_grouped_torch(x, ids, w, gate_up, down, LIMIT)
    sparse = _sparse(x, ids, w, gate_up, down)  # rounds its running sum after each expert
    args = (v.double() if v.is_floating_point() else v for v in (x, ids, w, gate_up, down))
    exact = _sparse(*args)
    scale = exact.abs().max()
    assert got.dtype == dtype and scale > 1
    # Every stored intermediate (gate/up, SwiGLU, down, weighted product) rounds to nearest like
    # torch (on the GPU, and in the interpreter with kvplan.ops._interpreter_bf16): at most
    # GEMM-order differences.
    assert _ulps(got, ref, scale, dtype) <= 2
    # vs sparse: the same products; sparse rounds its running sum k - 1 more times
    assert _ulps(got, sparse, scale, dtype) <= 2 + (k - 1)
    assert _ulps(ref, sparse, scale, dtype) <= k
    # one rounding of the sum is no less accurate than k
    err = (got.double() - exact).abs().mean()
    assert err <= 1.1 * (sparse.double() - exact).abs().mean()


@pytest.mark.parametrize("block_m", [1, 2, 4])
def test_group_pairs(block_m):
    gen = torch.Generator().manual_seed(block_m)
    e, t, k = 7, 9, 3
    ids = torch.randint(0, e - 2, (t, k), generator=gen)
    ids[2] = 4
    g = group_pairs(ids, e, block_m)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert g.offsets.tolist() == [0] + counts.cumsum(0).tolist()
    sorted_e = flat[g.order]
    assert (sorted_e[1:] >= sorted_e[:-1]).all()
    assert torch.equal(g.rows.long(), g.order // k)
    for tok in range(t):  # a token's positions: its own pairs, ascending experts, table order
        pos = g.token_pos[tok].long()
        assert (g.rows[pos] == tok).all() and (pos[1:] > pos[:-1]).all()
        assert sorted(g.order[pos].tolist()) == list(range(tok * k, tok * k + k))
    covered = torch.zeros(t * k, dtype=torch.int64)
    for ex, lo, hi in zip(g.tile_expert.tolist(), g.tile_start.tolist(), g.tile_end.tolist()):
        if lo >= hi:
            continue
        assert hi - lo <= block_m and (sorted_e[lo:hi] == ex).all()
        covered[lo:hi] += 1
    assert (covered == 1).all()  # every pair in exactly one tile
    assert g.tile_start.shape[0] == t * k // block_m + min(e, t * k)


def test_grouped_empty_and_errors():
    x, ids, w, gate_up, down = _case(0, 3, 4, 2)
    empty = moe_grouped_triton(x[:0], ids[:0], w[:0], gate_up, down, LIMIT)
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="ids"):
        moe_grouped(x, ids[:2], w[:2], gate_up, down, LIMIT)
    with pytest.raises(TypeError, match="gate_up"):
        moe_grouped(x, ids, w, gate_up.double(), down, LIMIT)
    with pytest.raises(ValueError, match="down"):
        moe_grouped(x, ids, w, gate_up, down[:, :, :3], LIMIT)
    with pytest.raises(ValueError, match="block_m"):
        group_pairs(ids, 4, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_cuda_graph_capture(dtype):
    gen = torch.Generator().manual_seed(0)
    e, k, t, hidden, inter = 64, 6, 8, 256, 128
    x = torch.randn(t, hidden, generator=gen).to("cuda", dtype)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.05).to("cuda", dtype)
    down = (torch.randn(e, hidden, inter, generator=gen) * 0.05).to("cuda", dtype)
    ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k].cuda()
    w = torch.rand(t, k, generator=gen).to("cuda", dtype)
    eager = moe_grouped(x, ids, w, gate_up, down, LIMIT)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_grouped(x, ids, w, gate_up, down, LIMIT)
    new_ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k].cuda()
    ids.copy_(new_ids)  # replay with other routing: nothing was baked in at capture
    graph.replay()
    torch.cuda.synchronize()
    want = moe_grouped(x, new_ids, w, gate_up, down, LIMIT)
    assert torch.equal(out, want)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    sparse = _sparse(x, new_ids, w, gate_up, down)
    torch.testing.assert_close(out, sparse, **tol)
    assert not torch.equal(eager, out)  # the routing change did reach the replay
