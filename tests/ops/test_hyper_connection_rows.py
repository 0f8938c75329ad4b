"""Row-tiled hyper-connection kernels (more than ``ROW_TILED_MIN_ROWS`` rows for hc_post,
``PRE_ROW_TILED_MIN_ROWS`` for hc_pre): bit for bit the one-token kernels (interpreter and
GPU), the torch path within fp32 rounding; their bf16 specializations compile for sm_90
without spills."""

from __future__ import annotations

import pytest
import torch

import kvplan.ops._hyper_connection_kernels as hck
import kvplan.ops.hyper_connection as hcm
from kvplan.ops.hyper_connection import (
    RowTile,
    hc_head_torch,
    hc_head_triton,
    hc_post_torch,
    hc_post_triton,
    hc_pre_torch,
    hc_pre_triton,
)
from tests.sm90_compile import sm90_stats

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS, HC_EPS = 1e-6, 1e-6
OLD = 10**9  # ROW_TILED_MIN_ROWS that keeps every size on the one-token kernels


def _inputs(seed, t, n, hidden, dtype, head=False, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    rows = n if head else (2 + n) * n
    s = torch.randn(t, n, hidden, generator=gen).to(dtype)
    fn = torch.randn(rows, n * hidden, generator=gen) * 0.02
    base = torch.randn(rows, generator=gen) * 0.1
    scale = 1 + 0.1 * torch.randn(1 if head else 3, generator=gen)
    out = torch.randn(t, hidden, generator=gen).to(dtype)
    return [z.to(device) for z in (s, fn, base, scale, out)]


def _both(monkeypatch, fn, min_rows=0):
    """(one-token kernels, row-tiled kernels) results of ``fn()`` (both ops' thresholds)."""
    for name in ("ROW_TILED_MIN_ROWS", "PRE_ROW_TILED_MIN_ROWS"):
        monkeypatch.setattr(hcm, name, OLD)
    old = fn()
    for name in ("ROW_TILED_MIN_ROWS", "PRE_ROW_TILED_MIN_ROWS"):
        monkeypatch.setattr(hcm, name, min_rows)
    return old, fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, n, hidden, tile", [(40, 4, 256, (16, 128)), (13, 3, 72, (4, 32))])
def test_rows_equal_one_token_kernels_bitwise(t, n, hidden, tile, dtype, monkeypatch):
    """TILE_T does not divide the rows, TILE_H not the hidden size (second case), n = 3 pads a
    stream; hc_pre (post, comb, x), hc_head and hc_post against the one-token kernels."""
    monkeypatch.setattr(hcm, "PRE_ROW_TILE", RowTile(*tile, 1))
    monkeypatch.setattr(hcm, "POST_ROW_TILE", RowTile(tile[0] // 2, tile[1] * 2, 1))
    s, fn, base, scale, out = _inputs(t + n, t, n, hidden, dtype)
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    old, new = _both(monkeypatch, lambda: hc_pre_triton(s, fn, base, scale, **kw))
    for name, a, b in zip(("post", "comb", "x"), old, new):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    post, comb, _ = old
    old, new = _both(monkeypatch, lambda: hc_post_triton(s, post, comb, out))
    assert torch.equal(old, new)
    hs, hfn, hbase, hscale, _ = _inputs(t, t, n, hidden, dtype, head=True)
    old, new = _both(monkeypatch, lambda: hc_head_triton(hs, hfn, hbase, hscale, hc_eps=HC_EPS,
                                                         eps=EPS))  # fmt: skip
    assert torch.equal(old, new)


def test_rows_match_torch(monkeypatch):
    t, n, hidden = 40, 4, 256
    monkeypatch.setattr(hcm, "ROW_TILED_MIN_ROWS", 0)
    monkeypatch.setattr(hcm, "PRE_ROW_TILED_MIN_ROWS", 0)
    monkeypatch.setattr(hcm, "PRE_ROW_TILE", RowTile(16, 128, 1))
    monkeypatch.setattr(hcm, "POST_ROW_TILE", RowTile(8, 256, 1))
    s, fn, base, scale, out = _inputs(1, t, n, hidden, torch.float32)
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    got = hc_pre_triton(s, fn, base, scale, **kw)
    want = hc_pre_torch(s.cpu(), fn.cpu(), base.cpu(), scale.cpu(), **kw)
    for name, g, w in zip(("post", "comb", "x"), got, want):
        torch.testing.assert_close(g.cpu(), w, atol=2e-6, rtol=2e-5, msg=name)
    post, comb = got[0], got[1]
    torch.testing.assert_close(hc_post_triton(s, post, comb, out).cpu(),
                               hc_post_torch(*(z.cpu() for z in (s, post, comb, out))),
                               atol=1.6e-5, rtol=2e-5)  # fmt: skip
    hs, hfn, hbase, hscale, _ = _inputs(2, t, n, hidden, torch.float32, head=True)
    torch.testing.assert_close(
        hc_head_triton(hs, hfn, hbase, hscale, hc_eps=HC_EPS, eps=EPS).cpu(),
        hc_head_torch(hs.cpu(), hfn.cpu(), hbase.cpu(), hscale.cpu(), hc_eps=HC_EPS, eps=EPS),
        atol=2e-6, rtol=2e-5,
    )  # fmt: skip


def test_default_dispatch_threshold():
    assert hcm.ROW_TILED_MIN_ROWS == 256  # decode sizes (CUDA graphs) keep the old kernels
    assert hcm.PRE_ROW_TILED_MIN_ROWS == 256
    for tile in (hcm.PRE_ROW_TILE, hcm.POST_ROW_TILE):
        assert all(v & (v - 1) == 0 for v in tile), tile


@pytest.mark.gpu
@pytest.mark.parametrize("t", [257, 1000, 4096, 8192])
def test_gpu_rows_equal_one_token_kernels_at_model_size(t, monkeypatch):
    """bf16 streams of 4 x 2,048: the projection's split counts at these sizes are 51, 16, 4
    and 2, so the weights' split sums take every reduction shape the prefill plans make."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    s, fn, base, scale, out = _inputs(t, t, 4, 2048, torch.bfloat16, device="cuda")
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    old, new = _both(monkeypatch, lambda: hc_pre_triton(s, fn, base, scale, **kw), 256)
    # the weights: the same code; x: the same explicit fma sequence over the streams (the
    # rows form summed in another order before and was measured 1 bf16 ulp off here)
    for name, a, b in zip(("post", "comb", "x"), old, new):
        assert torch.equal(a, b), name
    old, new = _both(monkeypatch, lambda: hc_post_triton(s, old[0], old[1], out), 256)
    assert torch.equal(old, new)


# hc_pre_kernel's per-token weights program of the row-tiled form
_WEIGHTS = dict(N=4, N_P=4, SPLITS_P=2, TILE_H=512, WEIGHTS_ONLY=True, NORM=False)


@pytest.mark.parametrize(
    "name, const, warps",
    [
        ("hc_pre_rows_kernel", dict(N=4, N_P=4, TILE_T=8, TILE_H=512), 8),
        ("hc_post_rows_kernel", dict(N=4, N_P=4, TILE_T=4, TILE_H=256), 8),
        ("hc_pre_kernel", {**_WEIGHTS, "N_PAD": 32, "HEAD": False}, 4),
        ("hc_pre_kernel", {**_WEIGHTS, "N_PAD": 16, "HEAD": True}, 4),
    ],
    ids=["pre-rows", "post-rows", "weights", "head-weights"],
)
def test_row_kernels_compile_for_sm90_without_spills(name, const, warps):
    """The model's shape (n = 4, bf16 streams) at the default row tiles."""
    assert [*hcm.PRE_ROW_TILE, *hcm.POST_ROW_TILE] == [8, 512, 8, 4, 256, 8]
    sig = {n: "*bf16" for n in ("s_ptr", "x_ptr", "out_ptr", "res_ptr")}
    sig.update({n: "fp32" for n in ("inv_k", "eps", "hc_eps", "inv_hidden", "norm_eps")})
    st = sm90_stats(getattr(hck, name), const, signature=sig, ptr_dtype="*fp32", num_warps=warps)
    assert st.spill_bytes == 0, st
