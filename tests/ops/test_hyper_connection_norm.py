"""The block's input RMSNorm inside the hyper-connection ops (`hc_pre` / `hc_post_pre` with
``norm``): equal to the op without it followed by `rms_norm_fp32w`, on the torch path exactly
(the same ops) and on the Triton kernels (the interpreter on CPU, the GPU when there is one)
in every form: the epilogue kernel holding whole rows (decode sizes), the residual update
fused in front, and the row-tiled form with its own norm launch (prefill sizes)."""

from __future__ import annotations

import pytest
import torch

from kvplan.ops import hyper_connection as hc
from kvplan.ops.rms_norm import rms_norm_fp32w_torch
from kvplan.ops.rope import NormSpec

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS, HC_EPS = 1e-6, 1e-6
KW = dict(iters=3, hc_eps=HC_EPS, eps=EPS)


def _case(seed, t, n, hidden, dtype):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(t, n, hidden, generator=gen).to(dtype)
    fn = torch.randn((2 + n) * n, n * hidden, generator=gen) * 0.2
    base = torch.randn((2 + n) * n, generator=gen) * 0.1
    scale = 1 + 0.1 * torch.randn(3, generator=gen)
    w = torch.rand(hidden, generator=gen) + 0.5
    post = torch.rand(t, n, generator=gen) * 2
    comb = torch.rand(t, n, n, generator=gen)
    out = torch.randn(t, hidden, generator=gen).to(dtype)
    return [v.to(DEV) for v in (s, fn, base, scale, w, post, comb, out)]


def _tol(dtype):
    # the kernels' sums run in their own order; bf16: a couple of bf16 steps of O(1) values
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_is_the_composition(dtype):
    s, fn, base, scale, w, *_ = (v.cpu() for v in _case(1, 5, 3, 24, dtype))
    post, comb, x = hc.hc_pre_torch(s, fn, base, scale, **KW)
    got = hc.hc_pre_torch(s, fn, base, scale, **KW, norm=NormSpec(w, EPS))
    assert torch.equal(got[0], post) and torch.equal(got[1], comb)
    assert torch.equal(got[2], rms_norm_fp32w_torch(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, n, hidden", [(5, 4, 40), (3, 2, 48)])
def test_pre_kernel_norm_matches_composition(t, n, hidden, dtype):
    """Decode sizes: one x program a token holds the whole (non power-of-two) row."""
    s, fn, base, scale, w, *_ = _case(t + hidden, t, n, hidden, dtype)
    post, comb, x = hc.hc_pre_triton(s, fn, base, scale, **KW, norm=NormSpec(w, EPS))
    ref = hc.hc_pre_torch(*(v.cpu() for v in (s, fn, base, scale)), **KW)
    want_x = rms_norm_fp32w_torch(ref[2], w.cpu(), EPS)
    torch.testing.assert_close(post.cpu(), ref[0], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(comb.cpu(), ref[1], atol=2e-6, rtol=2e-5)
    assert x.dtype == dtype and x.shape == (t, hidden)
    torch.testing.assert_close(x.cpu().float(), want_x.float(), **_tol(dtype))
    # the norm changed the rows: not the plain block input
    plain = hc.hc_pre_triton(s, fn, base, scale, **KW)[2]
    assert not torch.allclose(x.float(), plain.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_post_pre_kernel_norm_matches_composition(dtype):
    s, fn, base, scale, w, post, comb, out = _case(7, 6, 4, 40, dtype)
    got = hc.hc_post_pre_triton(s, post, comb, out, fn, base, scale, **KW,
                                norm=NormSpec(w, EPS))  # fmt: skip
    want = hc.hc_post_pre_torch(*(v.cpu() for v in (s, post, comb, out, fn, base, scale)),
                                **KW, norm=NormSpec(w.cpu(), EPS))  # fmt: skip
    plain = hc.hc_post_pre_triton(s, post, comb, out, fn, base, scale, **KW)
    assert torch.equal(got[0], plain[0])  # s' by the same kernel
    torch.testing.assert_close(got[3].cpu().float(), want[3].float(), **_tol(dtype))


def test_row_tiled_form_norms_after(monkeypatch):
    """Prefill sizes: the row-tiled x, then one `rms_norm_fp32w` launch."""
    monkeypatch.setattr(hc, "PRE_ROW_TILED_MIN_ROWS", 4)
    s, fn, base, scale, w, *_ = _case(9, 9, 2, 32, torch.float32)
    got = hc.hc_pre_triton(s, fn, base, scale, **KW, norm=NormSpec(w, EPS))[2]
    ref = hc.hc_pre_torch(*(v.cpu() for v in (s, fn, base, scale)), **KW)[2]
    torch.testing.assert_close(got.cpu(), rms_norm_fp32w_torch(ref, w.cpu(), EPS), **_tol(
        torch.float32))  # fmt: skip


def test_norm_errors():
    s, fn, base, scale, w, *_ = (v.cpu() for v in _case(3, 2, 2, 16, torch.float32))
    with pytest.raises(TypeError, match="norm must be None or a NormSpec with a weight"):
        hc.hc_pre(s, fn, base, scale, **KW, norm=NormSpec(None, EPS))
    with pytest.raises(ValueError, match="norm.weight"):
        hc.hc_pre(s, fn, base, scale, **KW, norm=NormSpec(w[:8], EPS))
    with pytest.raises(TypeError, match="norm.weight"):
        hc.hc_pre_triton(s, fn, base, scale, **KW, norm=NormSpec(w.double(), EPS))
