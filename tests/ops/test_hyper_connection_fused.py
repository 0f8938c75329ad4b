"""`hc_post_pre` (a residual update fused with the next connection): the Triton path equals
`hc_post_triton` then `hc_pre_triton` bit for bit (interpreter on CPU, the GPU when there is
one) and the torch composition within fp32 rounding; the torch path is that composition."""

from __future__ import annotations

import pytest
import torch

from kvplan.ops.hyper_connection import (
    hc_post_pre,
    hc_post_pre_torch,
    hc_post_pre_triton,
    hc_post_torch,
    hc_post_triton,
    hc_pre_torch,
    hc_pre_triton,
)

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS, HC_EPS = 1e-6, 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(seed: int, t: int, n: int, hidden: int, dtype: torch.dtype, device="cpu"):
    """(s, post, comb, out) of a block, and the next connection's (fn, base, scale)."""
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    s = torch.randn(t, n, hidden, generator=gen).to(dtype)
    fn0, fn1 = (torch.randn(rows, n * hidden, generator=gen) * 0.2 for _ in range(2))
    base = torch.randn(rows, generator=gen) * 0.1
    scale = 1 + 0.1 * torch.randn(3, generator=gen)
    post, comb, _ = hc_pre_torch(s, fn0, base, scale, iters=3, hc_eps=HC_EPS, eps=EPS)
    out = torch.randn(t, hidden, generator=gen).to(dtype)
    return [z.to(device) for z in (s, post, comb, out, fn1, base, scale)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "t, n, hidden, iters",
    [(1, 4, 40, 20), (5, 2, 24, 1), (18, 3, 44, 3), (33, 4, 72, 20)],  # T across row tiles
)
def test_triton_fused_equals_unfused_bitwise(t, n, hidden, iters, dtype):
    s, post, comb, out, fn, base, scale = _inputs(t + n, t, n, hidden, dtype, TRITON_DEVICE)
    kw = dict(iters=iters, hc_eps=HC_EPS, eps=EPS)
    s_want = hc_post_triton(s, post, comb, out)
    want = hc_pre_triton(s_want, fn, base, scale, **kw)
    got = hc_post_pre_triton(s, post, comb, out, fn, base, scale, **kw)
    assert torch.equal(got[0], s_want)
    for name, g, w in zip(("post", "comb", "x"), got[1:], want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fn_load_first_changes_no_bit(dtype, monkeypatch):
    """``hc_proj_kernel``'s ``fn`` load issued first (``FN_FIRST``, the default) or after the
    tile's read back: the same bits, fused and unfused."""
    import kvplan.ops.hyper_connection as hcm

    s, post, comb, out, fn, base, scale = _inputs(11, 18, 4, 40, dtype, TRITON_DEVICE)
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    assert hcm.FN_FIRST  # the default
    runs = []
    for first in (True, False):
        monkeypatch.setattr(hcm, "FN_FIRST", first)
        runs.append((*hc_post_pre_triton(s, post, comb, out, fn, base, scale, **kw),
                     *hc_pre_triton(s, fn, base, scale, **kw)))  # fmt: skip
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, n, hidden", [(6, 4, 40), (17, 3, 24)])
def test_triton_fused_matches_torch(t, n, hidden, dtype):
    args = _inputs(7 * t + n, t, n, hidden, dtype)
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    want = hc_post_pre_torch(*args, **kw)
    got = hc_post_pre_triton(*(a.to(TRITON_DEVICE) for a in args), **kw)
    # s': two rounded terms of size ~8, each summed in the kernel's own order
    s_tol = dict(atol=1.6e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2**-4, rtol=2e-2)
    torch.testing.assert_close(got[0].cpu(), want[0], **s_tol)
    # the connection's outputs against the torch path on the s' the kernels formed
    want = hc_pre_torch(got[0].cpu(), *args[4:], **kw)
    torch.testing.assert_close(got[1].cpu(), want[0], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(got[2].cpu(), want[1], atol=2e-6, rtol=2e-5)
    x_tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=2**-6, rtol=1.6e-2)
    torch.testing.assert_close(got[3].cpu(), want[2], **x_tol)


def test_torch_path_is_the_composition():
    s, post, comb, out, fn, base, scale = _inputs(3, 4, 3, 16, torch.float32)
    kw = dict(iters=5, hc_eps=HC_EPS, eps=EPS)
    got = hc_post_pre(s, post, comb, out, fn, base, scale, **kw)  # CPU: torch path
    s2 = hc_post_torch(s, post, comb, out)
    want = (s2, *hc_pre_torch(s2, fn, base, scale, **kw))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_dispatch_empty_and_errors(monkeypatch):
    kw = dict(iters=2, hc_eps=HC_EPS, eps=EPS)
    s, post, comb, out, fn, base, scale = _inputs(0, 0, 2, 8, torch.float32)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    got = hc_post_pre(s, post, comb, out, fn, base, scale, **kw)
    assert [tuple(g.shape) for g in got] == [(0, 2, 8), (0, 2), (0, 2, 2), (0, 8)]
    s, post, comb, out, fn, base, scale = _inputs(0, 3, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="out"):
        hc_post_pre(s, post, comb, out.double(), fn, base, scale, **kw)
    with pytest.raises(ValueError, match="fn"):
        hc_post_pre(s, post, comb, out, fn[:, :-1], base, scale, **kw)
    with pytest.raises(ValueError, match="iters"):
        hc_post_pre(s, post, comb, out, fn, base, scale, **{**kw, "iters": 0})


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 256, 4096])
def test_gpu_fused_equals_unfused_at_model_size(t):
    args = _inputs(t, t, 4, 2048, torch.bfloat16, "cuda")
    s, post, comb, out, fn, base, scale = args
    fn.mul_(0.1)
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    got = hc_post_pre(*args, **kw)
    s_want = hc_post_triton(s, post, comb, out)
    want = (s_want, *hc_pre_triton(s_want, fn, base, scale, **kw))
    for name, g, w in zip(("s", "post", "comb", "x"), got, want):
        assert torch.equal(g, w), name
    # against torch: s' within bf16 rounding (the two round the residual update differently,
    # a last bit in a few of the T x 8192 values: one ulp up to |s'| < 8), then the mixing
    # weights from the same s' in fp32 tolerance (a last bit of s' moves the logits by more)
    torch.testing.assert_close(got[0], hc_post_torch(s, post, comb, out), atol=2**-5, rtol=1.6e-2)
    ref = hc_pre_torch(got[0], fn, base, scale, **kw)
    torch.testing.assert_close(got[1], ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[2], ref[1], atol=2e-5, rtol=2e-5)
