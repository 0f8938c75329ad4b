"""Hyper-connection ops: torch path == a per-token loop reference; Triton == torch (interpreter
on CPU, the GPU when there is one) within fp32 rounding (one bf16 rounding step for bf16)."""

from __future__ import annotations

import math

import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops.hyper_connection import (
    hc_head,
    hc_head_torch,
    hc_head_triton,
    hc_post,
    hc_post_torch,
    hc_post_triton,
    hc_pre,
    hc_pre_torch,
    hc_pre_triton,
)

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS, HC_EPS = 1e-6, 1e-6


def _inputs(seed: int, t: int, n: int, hidden: int, dtype: torch.dtype, head: bool = False):
    gen = torch.Generator().manual_seed(seed)
    rows = n if head else (2 + n) * n
    s = torch.randn(t, n, hidden, generator=gen).to(dtype)
    fn = torch.randn(rows, n * hidden, generator=gen) * 0.2
    base = torch.randn(rows, generator=gen) * 0.1
    scale = 1 + 0.1 * torch.randn(1 if head else 3, generator=gen)
    return s, fn, base, scale


def _tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """fp32: rounding noise; bf16: a couple of bf16 steps of values of size ``scale`` (the
    kernels sum in their own order, the GPU's tensor-core form in three bf16 parts)."""
    if dtype == torch.float32:
        return dict(atol=2e-6 * scale, rtol=2e-5)
    return dict(atol=2**-7 * scale, rtol=1.6e-2)


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


def _loop_reference(s, fn, base, scale, iters):
    """One token at a time with Python scalars (float64): (post, comb, x in fp64)."""
    t, n, hidden = s.shape
    outs = []
    for row in s.double():
        flat = row.flatten()
        r = 1 / math.sqrt(float(flat.square().mean()) + EPS)
        f = [float(w @ flat) * r for w in fn.double()]
        sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
        pre = [sig(f[i] * float(scale[0]) + float(base[i])) + HC_EPS for i in range(n)]
        post = [2 * sig(f[n + i] * float(scale[1]) + float(base[n + i])) for i in range(n)]
        c = [[f[2 * n + i * n + j] * float(scale[2]) + float(base[2 * n + i * n + j])
              for j in range(n)] for i in range(n)]  # fmt: skip
        for i in range(n):
            m = max(c[i])
            e = [math.exp(v - m) for v in c[i]]
            c[i] = [v / sum(e) + HC_EPS for v in e]

        def cols(c):
            sums = [sum(c[i][j] for i in range(n)) + HC_EPS for j in range(n)]
            return [[c[i][j] / sums[j] for j in range(n)] for i in range(n)]

        c = cols(c)
        for _ in range(iters - 1):
            c = [[v / (sum(r_) + HC_EPS) for v in r_] for r_ in c]
            c = cols(c)
        x = sum(pre[i] * row[i].double() for i in range(n))
        outs.append(
            (torch.tensor(post, dtype=torch.float64), torch.tensor(c, dtype=torch.float64), x)
        )
    return [torch.stack(z) for z in zip(*outs)]


@pytest.mark.parametrize("n, iters", [(2, 1), (3, 3), (4, 20)])
def test_torch_path_matches_loop_reference(n, iters):
    s, fn, base, scale = _inputs(n, 3, n, 8, torch.float32)
    post, comb, x = hc_pre_torch(s, fn, base, scale, iters=iters, hc_eps=HC_EPS, eps=EPS)
    want_post, want_comb, want_x = _loop_reference(s, fn, base, scale, iters)
    torch.testing.assert_close(post.double(), want_post, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(comb.double(), want_comb, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.double(), want_x, atol=1e-5, rtol=1e-5)
    # rows of comb sum to ~1 after enough iterations
    if iters == 20:
        torch.testing.assert_close(comb.sum(-1), torch.ones(3, n), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, iters", [(2, 1), (2, 20), (3, 3), (4, 1), (4, 20)])
def test_pre_triton_matches_torch(n, iters, dtype):
    t, hidden = (5, 48) if n != 4 else (18, 40)  # 18 rows: two row tiles of the projection
    s, fn, base, scale = _inputs(10 * n + iters, t, n, hidden, dtype)
    want = hc_pre_torch(s, fn, base, scale, iters=iters, hc_eps=HC_EPS, eps=EPS)
    got = hc_pre_triton(
        *_to(TRITON_DEVICE, s, fn, base, scale), iters=iters, hc_eps=HC_EPS, eps=EPS
    )
    for name, g, w in zip(("post", "comb", "x"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        tol = dict(atol=2e-6, rtol=2e-5) if name != "x" else _tol(dtype)
        torch.testing.assert_close(g.cpu(), w, **tol, msg=name)


@pytest.mark.parametrize("t, n, hidden", [(20, 4, 40), (18, 3, 24)])
def test_pre_triton_tensor_core_form_matches_torch(t, n, hidden, monkeypatch):
    """Prefill-sized bf16 rows take the projection's tensor-core form (fn in three bf16
    parts): fp32 accuracy, like the IEEE form, and the same mixing weights to fp32 rounding.
    (The row threshold is lowered so the interpreter runs few programs.)"""
    import kvplan.ops.hyper_connection as hcm

    assert hcm._proj_plan(hcm.TC_MIN_ROWS + 1, n, hidden, torch.bfloat16).tc
    assert not hcm._proj_plan(hcm.TC_MIN_ROWS + 1, n, hidden, torch.float32).tc
    monkeypatch.setattr(hcm, "TC_MIN_ROWS", 8)
    assert not hcm._proj_plan(8, n, hidden, torch.bfloat16).tc
    s, fn, base, scale = _inputs(t + n, t, n, hidden, torch.bfloat16)
    assert hcm._proj_plan(t, n, hidden, torch.bfloat16).tc
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    want = hc_pre_torch(s, fn, base, scale, **kw)
    got = hc_pre_triton(*_to(TRITON_DEVICE, s, fn, base, scale), **kw)
    for name, g, w in zip(("post", "comb", "x"), got, want):
        tol = dict(atol=2e-6, rtol=2e-5) if name != "x" else _tol(torch.bfloat16)
        torch.testing.assert_close(g.cpu(), w, **tol, msg=name)


@pytest.mark.gpu
def test_gpu_pre_tensor_core_form_at_model_size():
    s, fn, base, scale = _inputs(3, 4096, 4, 2048, torch.bfloat16)
    fn = fn * 0.1
    kw = dict(iters=20, hc_eps=HC_EPS, eps=EPS)
    want = hc_pre_torch(*_to(torch.device("cuda"), s, fn, base, scale), **kw)
    got = hc_pre_triton(*_to(torch.device("cuda"), s, fn, base, scale), **kw)
    for name, g, w in zip(("post", "comb", "x"), got, want):
        tol = dict(atol=1e-5, rtol=1e-4) if name != "x" else _tol(torch.bfloat16)
        torch.testing.assert_close(g, w, **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_head_triton_matches_torch(n, dtype):
    s, fn, base, scale = _inputs(n, 6, n, 40, dtype, head=True)
    want = hc_head_torch(s, fn, base, scale, hc_eps=HC_EPS, eps=EPS)
    got = hc_head_triton(*_to(TRITON_DEVICE, s, fn, base, scale), hc_eps=HC_EPS, eps=EPS)
    assert got.dtype == dtype and got.shape == (6, 40)
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_post_triton_matches_torch(n, dtype):
    s, fn, base, scale = _inputs(n, 7, n, 200, dtype)  # 200: two hidden tiles, one partial
    post, comb, _ = hc_pre_torch(s, fn, base, scale, iters=3, hc_eps=HC_EPS, eps=EPS)
    out = torch.randn(7, 200, generator=torch.Generator().manual_seed(n)).to(dtype)
    want = hc_post_torch(s, post, comb, out)
    # the independent formula, in fp64
    ref = post.double()[..., None] * out.double()[:, None] + torch.einsum(
        "tjk,tjh->tkh", comb.double(), s.double()
    )
    torch.testing.assert_close(want.double(), ref, **_tol(dtype, scale=8.0))
    got = hc_post_triton(*_to(TRITON_DEVICE, s, post, comb, out))
    assert got.dtype == dtype
    # two rounded terms are added: cancellation leaves an absolute error of their size
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype, scale=8.0))


def test_dispatch_and_empty(monkeypatch):
    s, fn, base, scale = _inputs(0, 0, 2, 8, torch.float32)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    post, comb, x = hc_pre(s, fn, base, scale, iters=2, hc_eps=HC_EPS, eps=EPS)
    assert post.shape == (0, 2) and comb.shape == (0, 2, 2) and x.shape == (0, 8)
    assert hc_post(s, post, comb, x).shape == (0, 2, 8)
    hs, hfn, hbase, hscale = _inputs(0, 0, 2, 8, torch.float32, head=True)
    assert hc_head(hs, hfn, hbase, hscale, hc_eps=HC_EPS, eps=EPS).shape == (0, 8)


def test_errors():
    s, fn, base, scale = _inputs(0, 2, 2, 8, torch.float32)
    kw = dict(hc_eps=HC_EPS, eps=EPS)
    with pytest.raises(ValueError, match="fn"):
        hc_pre(s, fn[:, :-1], base, scale, iters=2, **kw)
    with pytest.raises(TypeError, match="fn"):
        hc_pre(s, fn.double(), base, scale, iters=2, **kw)
    with pytest.raises(ValueError, match="scale"):
        hc_pre(s, fn, base, scale[:2], iters=2, **kw)
    with pytest.raises(ValueError, match="iters"):
        hc_pre(s, fn, base, scale, iters=0, **kw)
    with pytest.raises(ValueError, match="s must be 3-D"):
        hc_pre(s[0], fn, base, scale, iters=2, **kw)
    post, comb, x = hc_pre(s, fn, base, scale, iters=2, **kw)
    with pytest.raises(TypeError, match="out"):
        hc_post(s, post, comb, x.double())
    with pytest.raises(ValueError, match="comb"):
        hc_post(s, post, comb[:1], x)


@pytest.mark.parametrize("fn_first", [False, True], ids=["fn-after", "fn-first"])
@pytest.mark.parametrize("tc", [False, True], ids=["ieee", "tensor-core"])
def test_projection_kernel_compiles_for_sm90(tc, fn_first):
    """The model's shape (n = 4 streams of 2,048, 24 outputs) in the plan a prefill-sized
    bf16 call takes: the tensor-core form's bf16 dots compile for the H200 (the interpreter
    runs them too, with ``kvplan.ops._interpreter_bf16``'s exact bf16 dot), with the ``fn``
    load first or after the tile (``FN_FIRST``)."""
    from kvplan.ops._hyper_connection_kernels import hc_proj_kernel

    sig = {"s_ptr": "*bf16", "out_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32",
           "comb_ptr": "*fp32", "fn_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32"}  # fmt: skip
    compile_sm90(hc_proj_kernel, "*fp32", sig, N=4, N_P=4, TILE_T=64, TILE_H=32, N_PAD=32,
                 FUSED=False, TC=tc, FN_FIRST=fn_first)  # fmt: skip


@pytest.mark.parametrize("t, tiles_per_program", [(1, 1), (32, 1), (64, 1), (256, 4)])
def test_decode_projection_plan_follows_the_program_target(t, tiles_per_program, monkeypatch):
    """Decode-sized projections (up to 256 rows) split K until about ``PROJ_PROGRAMS[0]``
    programs run, never below one K tile a program (the GPU's plan at the shapes of the
    DeepSeek-V4 bench: 4 streams x 2,048 hidden, bf16 rows on the tensor-core form's
    32-column K tiles per stream)."""
    import kvplan.ops.hyper_connection as hcm

    monkeypatch.setattr(hcm, "triton_interpreting", lambda: False)
    monkeypatch.setattr(hcm, "PROJ_PROGRAMS", (256, 256))
    plan = hcm._proj_plan(t, 4, 2048, torch.bfloat16)
    assert plan.tc and plan.tile_h == 32
    assert plan.h_per_split == tiles_per_program * plan.tile_h
    assert plan.splits * plan.h_per_split == 2048
    prefill = hcm._proj_plan(8192, 4, 2048, torch.bfloat16)
    assert prefill.h_per_split > prefill.tile_h  # prefill keeps several K tiles a program


def test_projection_row_tile_at_decode_sizes(monkeypatch):
    """16-row tiles up to ``SMALL_TILE_ROWS`` rows (256: the 32-row tensor-core tile spills on
    sm_90), 64 above; a lower ``KVPLAN_HC_SMALL_ROWS`` brings back 32-row tiles up to 256 rows;
    it is parsed with a clear error."""
    import kvplan.ops.hyper_connection as hcm

    monkeypatch.setattr(hcm, "triton_interpreting", lambda: False)
    tiles = {t: hcm._proj_plan(t, 4, 2048, torch.bfloat16).tile_t for t in (8, 32, 33, 256, 257)}
    assert tiles == {8: 16, 32: 16, 33: 16, 256: 16, 257: 64}
    monkeypatch.setattr(hcm, "SMALL_TILE_ROWS", 32)
    tiles = {t: hcm._proj_plan(t, 4, 2048, torch.bfloat16).tile_t for t in (32, 33, 256, 257)}
    assert tiles == {32: 16, 33: 32, 256: 32, 257: 64}
    monkeypatch.setenv("KVPLAN_HC_SMALL_ROWS", "16")
    assert hcm._small_tile_rows() == 16
    monkeypatch.setenv("KVPLAN_HC_SMALL_ROWS", "-1")
    with pytest.raises(ValueError, match="KVPLAN_HC_SMALL_ROWS"):
        hcm._small_tile_rows()
