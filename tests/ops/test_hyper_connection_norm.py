"""A block's input RMSNorm fused into its hyper-connection (`hc_pre` / `hc_post_pre` /
`hc_head` with ``norm=(weight, eps)``): the result equals the connection's ``x`` through
`rms_norm_fp32w` bit for bit (Triton: the interpreter on CPU, the GPU when there is one; torch:
the composition), the mixing weights do not change, and decode sizes launch no separate norm."""

from __future__ import annotations

import pytest
import torch

import kvplan.ops.hyper_connection as hcm
from kvplan.ops import _hyper_connection_kernels as hck
from kvplan.ops.hyper_connection import (
    hc_head,
    hc_head_torch,
    hc_head_triton,
    hc_post_pre,
    hc_post_pre_torch,
    hc_post_pre_triton,
    hc_pre,
    hc_pre_torch,
    hc_pre_triton,
)
from kvplan.ops.rms_norm import rms_norm_fp32w_torch, rms_norm_fp32w_triton
from tests.sm90_compile import sm90_loop_ops, sm90_stats

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS, HC_EPS, NORM_EPS = 1e-6, 1e-6, 1e-5


def _inputs(seed: int, t: int, n: int, hidden: int, dtype: torch.dtype, device="cpu"):
    """(s, fn, base, scale, post, comb, out, head_fn, head_base, head_scale, weight)."""
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    s = (torch.randn(t, n, hidden, generator=gen) * 2).to(dtype)
    fn = torch.randn(rows, n * hidden, generator=gen) * 0.2
    base = torch.randn(rows, generator=gen) * 0.1
    scale = 1 + 0.1 * torch.randn(3, generator=gen)
    post, comb, _ = hc_pre_torch(s, fn, base, scale, iters=3, hc_eps=HC_EPS, eps=EPS)
    out = torch.randn(t, hidden, generator=gen).to(dtype)
    hfn = torch.randn(n, n * hidden, generator=gen) * 0.2
    hbase = torch.randn(n, generator=gen) * 0.1
    hscale = 1 + 0.1 * torch.randn(1, generator=gen)
    weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    vals = (s, fn, base, scale, post, comb, out, hfn, hbase, hscale, weight)
    return [v.to(device) for v in vals]


def _three_ops(v, norm, pre_fn, post_pre_fn, head_fn, iters=3):
    """(post, comb, x) of hc_pre, (s', post, comb, x) of hc_post_pre, and hc_head's row."""
    s, fn, base, scale, post, comb, out, hfn, hbase, hscale, _ = v
    kw = dict(iters=iters, hc_eps=HC_EPS, eps=EPS, norm=norm)
    return (
        pre_fn(s, fn, base, scale, **kw),
        post_pre_fn(s, post, comb, out, fn, base, scale, **kw),
        head_fn(s, hfn, hbase, hscale, hc_eps=HC_EPS, eps=EPS, norm=norm),
    )


def _check_norm_equals_unfused(v, normed, plain, rms):
    """``normed`` (with the norm) against ``plain`` (without) and ``rms`` over its rows:
    everything but the block inputs identical, the block inputs ``rms(x)``: bit for bit on the
    CPU, within a last bit on a GPU (the fused program sums the squares in its own order)."""
    weight = v[-1]
    (post_n, comb_n, x_n), (s2_n, post2_n, comb2_n, x2_n), h_n = normed
    (post, comb, x), (s2, post2, comb2, x2), h = plain
    for name, a, b in [("post", post_n, post), ("comb", comb_n, comb), ("s'", s2_n, s2),
                       ("post'", post2_n, post2), ("comb'", comb2_n, comb2)]:  # fmt: skip
        assert torch.equal(a, b), name
    for name, a, b in [("x", x_n, x), ("x'", x2_n, x2), ("head", h_n, h)]:
        want = rms(b, weight, NORM_EPS)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.is_cuda:  # one rounding of the scale apart: a last bit of some entries
            ulp = 2.0**-7 if a.dtype == torch.bfloat16 else 2.0**-22
            torch.testing.assert_close(a, want, rtol=ulp, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, want), (name, (a.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, n, hidden", [(1, 4, 40), (5, 2, 24), (33, 3, 72), (260, 2, 24)])
def test_triton_norm_equals_connection_then_rms_norm(t, n, hidden, dtype, fused, monkeypatch):
    """With ``FUSED_NORM`` decode sizes fuse the norm (up to ``PRE_ROW_TILED_MIN_ROWS`` rows);
    260 rows, and every size without it, run `rms_norm_fp32w_triton` after the connection."""
    monkeypatch.setattr(hcm, "FUSED_NORM", fused)
    v = _inputs(t * 7 + n, t, n, hidden, dtype, TRITON_DEVICE)
    norm = (v[-1], NORM_EPS)
    ops = (hc_pre_triton, hc_post_pre_triton, hc_head_triton)
    _check_norm_equals_unfused(
        v, _three_ops(v, norm, *ops), _three_ops(v, None, *ops), rms_norm_fp32w_triton
    )


def test_torch_norm_is_the_composition():
    v = _inputs(11, 6, 3, 32, torch.bfloat16)
    norm = (v[-1], NORM_EPS)
    ops = (hc_pre_torch, hc_post_pre_torch, hc_head_torch)
    _check_norm_equals_unfused(
        v, _three_ops(v, norm, *ops), _three_ops(v, None, *ops), rms_norm_fp32w_torch
    )
    # the public entry points take the torch path on CPU tensors
    _check_norm_equals_unfused(
        v, _three_ops(v, norm, hc_pre, hc_post_pre, hc_head), _three_ops(v, None, *ops),
        rms_norm_fp32w_torch,
    )  # fmt: skip


def test_triton_norm_matches_torch():
    v = _inputs(5, 9, 4, 48, torch.float32)
    norm = (v[-1], NORM_EPS)
    want = _three_ops(v, norm, hc_pre_torch, hc_post_pre_torch, hc_head_torch)
    vd = [z.to(TRITON_DEVICE) for z in v]
    got = _three_ops(vd, (vd[-1], NORM_EPS), hc_pre_triton, hc_post_pre_triton, hc_head_triton)
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[0][2].cpu(), want[0][2], **tol)
    torch.testing.assert_close(got[1][3].cpu(), want[1][3], **tol)
    torch.testing.assert_close(got[2].cpu(), want[2], **tol)


def test_decode_sizes_launch_no_separate_norm(monkeypatch):
    """With ``FUSED_NORM`` (``KVPLAN_HC_FUSED_NORM=1``) decode sizes call no
    `rms_norm_fp32w_triton`; without it they do, with the same bits (on the CPU)."""
    monkeypatch.setattr(hcm, "FUSED_NORM", True)
    calls = []
    real = hcm.rms_norm_fp32w_triton

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(hcm, "rms_norm_fp32w_triton", counted)
    v = _inputs(3, 4, 2, 24, torch.bfloat16, TRITON_DEVICE)
    norm = (v[-1], NORM_EPS)
    ops = (hc_pre_triton, hc_post_pre_triton, hc_head_triton)
    fused = _three_ops(v, norm, *ops)
    assert calls == []
    monkeypatch.setattr(hcm, "FUSED_NORM", False)
    unfused = _three_ops(v, norm, *ops)
    assert calls == [4, 4, 4]
    for a, b in zip(fused[:2], unfused[:2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(fused[2], unfused[2])


def test_norm_errors_name_the_field():
    s, fn, base, scale, *_, weight = _inputs(2, 3, 2, 16, torch.float32)
    kw = dict(iters=2, hc_eps=HC_EPS, eps=EPS)
    for f in (hc_pre_torch, hc_pre_triton):
        with pytest.raises(ValueError, match="norm weight"):
            f(s, fn, base, scale, **kw, norm=(weight[:-1], NORM_EPS))
        with pytest.raises(TypeError, match="norm weight"):
            f(s, fn, base, scale, **kw, norm=(weight.double(), NORM_EPS))
        with pytest.raises(ValueError, match="norm eps"):
            f(s, fn, base, scale, **kw, norm=(weight, -1.0))
        with pytest.raises(TypeError, match="norm must be"):
            f(s, fn, base, scale, **kw, norm=weight)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 256])
def test_gpu_norm_equals_connection_then_rms_norm_at_model_size(t, monkeypatch):
    """DeepSeek-V4's shape (4 bf16 streams of 2,048, 20 Sinkhorn rounds): the mixing weights
    keep their bits, the fused norm's row is `_rms_norm_kernel`'s within a last bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    monkeypatch.setattr(hcm, "FUSED_NORM", True)
    v = _inputs(t, t, 4, 2048, torch.bfloat16, "cuda")
    v[1].mul_(0.1)
    norm = (v[-1], NORM_EPS)
    ops = (hc_pre_triton, hc_post_pre_triton, hc_head_triton)
    _check_norm_equals_unfused(
        v, _three_ops(v, norm, *ops, iters=20), _three_ops(v, None, *ops, iters=20),
        rms_norm_fp32w_triton,
    )  # fmt: skip


def test_fused_norm_program_compiles_for_sm90():
    """The decode launch at DeepSeek-V4's shape (4 bf16 streams of 2,048, one warp): the row
    of 2,048 fp32 values in 32 threads fills the registers; ptxas spills 44 bytes a thread
    (Triton 3.6), which this bounds."""
    const = dict(N=4, N_P=4, N_PAD=32, SPLITS_P=16, TILE_H=2048, HEAD=False,
                 WEIGHTS_ONLY=False, NORM=True)  # fmt: skip
    sig = {n: "*bf16" for n in ("s_ptr", "x_ptr")}
    sig.update({n: "fp32" for n in ("inv_k", "eps", "hc_eps", "inv_hidden", "norm_eps")})
    st = sm90_stats(hck.hc_pre_kernel, const, signature=sig, ptr_dtype="*fp32", num_warps=1)
    assert st.spill_bytes <= 64, st


# --- the decode launch's warps (KVPLAN_HC_PRE_WARPS, default 1) ---


@pytest.mark.parametrize("warps", [2, 4])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_warps_match_one_warp(dtype, iters, warps, monkeypatch):
    """``hc_pre_kernel``'s decode launch at ``warps`` warps: ``post`` / ``comb`` within fp32
    rounding of the one-warp launch's and of the torch path's (the split partials and a
    row's entries reduce in the launch's layout), each column of ``comb`` normalised; ``x`` /
    ``s'`` within a rounding of their inputs', on hc_pre, hc_post_pre and with the norm."""
    v = _inputs(31 + iters, 6, 4, 40, dtype, TRITON_DEVICE)
    norm = (v[-1], NORM_EPS)

    def run(w: int):
        monkeypatch.setattr(hcm, "PRE_DECODE_WARPS", w)
        return _three_ops(v, norm, hc_pre_triton, hc_post_pre_triton, hc_head_triton, iters)

    (post_r, comb_r, x_r), (s2_r, post2_r, comb2_r, x2_r), head_r = run(warps)
    (post_t, comb_t, x_t), (s2_t, post2_t, comb2_t, x2_t), head_t = run(1)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for name, a, b in [("post", post_r, post_t), ("comb", comb_r, comb_t),
                       ("post'", post2_r, post2_t), ("comb'", comb2_r, comb2_t)]:  # fmt: skip
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    for name, a, b in [("x", x_r, x_t), ("s'", s2_r, s2_t), ("x'", x2_r, x2_t),
                       ("head", head_r, head_t)]:  # fmt: skip
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    s, fn, base, scale = v[:4]
    post_w, comb_w, _ = hc_pre_torch(s.cpu(), fn.cpu(), base.cpu(), scale.cpu(), iters=iters,
                                     hc_eps=HC_EPS, eps=EPS)  # fmt: skip
    torch.testing.assert_close(comb_r.cpu(), comb_w, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(post_r.cpu(), post_w, atol=2e-6, rtol=2e-5)
    # the last half-round normalises the columns: each sums to 1 up to eps and rounding
    ones = torch.ones(6, 4, dtype=torch.float32)
    torch.testing.assert_close(comb_r.sum(-2).cpu(), ones, atol=1e-5, rtol=0)


def test_decode_warps_default_and_bad_setting(monkeypatch):
    """One decode warp by default, four for prefill sizes; a bad ``KVPLAN_HC_PRE_WARPS``
    names the variable when the module loads."""
    import importlib

    assert hcm.PRE_DECODE_WARPS == 1
    assert hcm._epilogue_warps(32) == 1 and hcm._epilogue_warps(512) == 4
    try:
        monkeypatch.setenv("KVPLAN_HC_PRE_WARPS", "4")
        assert importlib.reload(hcm)._epilogue_warps(32) == 4
        monkeypatch.setenv("KVPLAN_HC_PRE_WARPS", "3")
        with pytest.raises(ValueError, match="KVPLAN_HC_PRE_WARPS must be 1, 2, 4 or 8, got 3"):
            importlib.reload(hcm)
    finally:
        monkeypatch.delenv("KVPLAN_HC_PRE_WARPS", raising=False)
        importlib.reload(hcm)


def test_four_warp_decode_launch_compiles_for_sm90():
    """The decode launch at DeepSeek-V4's shape (4 bf16 streams of 2,048, the fused norm) at
    four warps: no spills (one warp spills the 2,048-wide row, `test_fused_norm_...`), and
    the Sinkhorn rounds' loop has no barrier (each warp holds the token's 4 x 4 matrix)."""
    const = dict(N=4, N_P=4, N_PAD=32, SPLITS_P=64, TILE_H=2048, HEAD=False,
                 WEIGHTS_ONLY=False, NORM=True)  # fmt: skip
    sig = {n: "*bf16" for n in ("s_ptr", "x_ptr")}
    sig.update({n: "fp32" for n in ("inv_k", "eps", "hc_eps", "inv_hidden", "norm_eps")})
    st = sm90_stats(hck.hc_pre_kernel, const, signature=sig, ptr_dtype="*fp32", num_warps=4)
    assert st.spill_bytes == 0, st
    loops = sm90_loop_ops(hck.hc_pre_kernel, const, ("BAR", "SHFL"), signature=sig,
                          ptr_dtype="*fp32", num_warps=4)  # fmt: skip
    assert len(loops) == 1 and loops[0]["BAR"] == 0, loops
