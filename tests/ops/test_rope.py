"""``kvplan.ops.rope.norm_rope``: the Triton kernel (interpreter on CPU) against the torch ops it
replaces, and the torch path against an independent per-pair loop."""

from __future__ import annotations

import math

import pytest
import torch

from kvplan.ops.rope import (
    NormSpec,
    norm_rope,
    norm_rope_pair,
    norm_rope_pair_triton,
    norm_rope_torch,
    norm_rope_triton,
)


def tables(t: int, half: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 5000, (t,), generator=gen).float()
    inv = 1.0 / (10000 ** (torch.arange(half).float() / half))
    ang = pos[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def loop_rope(x: torch.Tensor, cos, sin, inverse: bool) -> torch.Tensor:
    """Per-pair float64 loop: the rotation of each adjacent pair of the trailing channels."""
    out = x.double().clone()
    x3 = out if out.dim() == 3 else out[:, None]
    d, half = x.shape[-1], cos.shape[1]
    for t in range(x3.shape[0]):
        for i in range(half):
            a = d - 2 * half + 2 * i
            c, s = float(cos[t, i]), float(sin[t, i]) * (-1 if inverse else 1)
            x0, x1 = x3[t, :, a].clone(), x3[t, :, a + 1].clone()
            x3[t, :, a], x3[t, :, a + 1] = x0 * c - x1 * s, x1 * c + x0 * s
    return out


@pytest.mark.parametrize("shape,half", [((5, 32), 8), ((3, 4, 64), 16), ((2, 2, 16), 8)])
@pytest.mark.parametrize("inverse", [False, True])
def test_torch_path_equals_pair_loop(shape, half, inverse):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    cos, sin = tables(shape[0], half, torch.float32, 2)
    got = norm_rope_torch(x, cos, sin, inverse=inverse)
    torch.testing.assert_close(got.double(), loop_rope(x, cos, sin, inverse), atol=1e-5, rtol=0)
    assert math.isclose(float(got.norm()), float(x.norm()), rel_tol=1e-5)  # a rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["none", "weighted", "unweighted"])
@pytest.mark.parametrize("shape,half", [((6, 64), 16), ((3, 4, 32), 8)])
def test_triton_equals_torch(dtype, norm, shape, half):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    cos, sin = tables(shape[0], half, dtype, 4)
    spec = {
        "none": None,
        "weighted": NormSpec(torch.rand(shape[-1], generator=gen) + 0.5, 1e-6),
        "unweighted": NormSpec(None, 1e-6),
    }[norm]
    for inverse in (False, True):
        want = norm_rope_torch(x, cos, sin, norm=spec, inverse=inverse)
        got = norm_rope_triton(x, cos, sin, norm=spec, inverse=inverse)
        assert got.dtype == x.dtype and got.shape == x.shape
        if dtype == torch.float32 and norm == "none":
            assert torch.equal(got, want)  # the same single roundings
        else:  # the interpreter's bf16 rounding / the norm's sum order may differ by an ulp
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


def test_strided_input_and_dispatch():
    """A column view (the fused projection's output) reads in place; CPU dispatch is torch."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(4, 96, generator=gen)
    x = big[:, 16:80]  # [4, 64], row stride 96
    cos, sin = tables(4, 8, torch.float32, 6)
    want = norm_rope_torch(x.contiguous(), cos, sin, norm=NormSpec(None, 1e-6))
    torch.testing.assert_close(norm_rope_triton(x, cos, sin, norm=NormSpec(None, 1e-6)), want)
    assert torch.equal(norm_rope(x, cos, sin, norm=NormSpec(None, 1e-6)), want)


def _pair_case(seed: int, t: int, heads: int, d: int, half: int, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    q_wide = (torch.randn(t, heads * d + 32, generator=gen) * 3).to(dtype)  # a column view
    q = q_wide[:, 32:].unflatten(-1, (heads, d))
    kv_wide = (torch.randn(t, d + 16, generator=gen) * 3).to(dtype)
    kv = kv_wide[:, :d]
    cos, sin = tables(t, half, dtype, seed + 1)
    weight = torch.rand(d, generator=gen) + 0.5
    return [v.to(device) for v in (q, kv, cos, sin, weight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_launch_equals_two_launches(dtype):
    """`norm_rope_pair`: a layer's queries (unweighted norm) and K = V row (weighted norm) in
    one launch, strided views as the fused projections give them: the same bits as two
    `norm_rope_triton` launches, and the torch pair within rounding."""
    q, kv, cos, sin, w = _pair_case(11, 5, 3, 64, 16, dtype, "cpu")
    qn, kvn = NormSpec(None, 1e-6), NormSpec(w, 1e-6)
    got_q, got_kv = norm_rope_pair_triton(q, kv, cos, sin, qn, kvn)
    assert torch.equal(got_q, norm_rope_triton(q, cos, sin, norm=qn))
    assert torch.equal(got_kv, norm_rope_triton(kv, cos, sin, norm=kvn))
    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_q, norm_rope_torch(q, cos, sin, norm=qn), **tol)
    torch.testing.assert_close(got_kv, norm_rope_torch(kv, cos, sin, norm=kvn), **tol)


def test_pair_errors():
    q, kv, cos, sin, w = _pair_case(12, 4, 2, 32, 8, torch.float32, "cpu")
    qn, kvn = NormSpec(None, 1e-6), NormSpec(w, 1e-6)
    with pytest.raises(ValueError, match="x2 \\[T, D\\]"):
        norm_rope_pair_triton(q, kv.bfloat16(), cos, sin, qn, kvn)
    with pytest.raises(ValueError, match="x2 \\[T, D\\]"):
        norm_rope_pair_triton(q, q, cos, sin, qn, kvn)
    with pytest.raises(ValueError, match="cos must be"):
        norm_rope_pair_triton(q, kv, cos[:3], sin[:3], qn, kvn)
    # the dispatching entry on CPU tensors: the two torch calls
    got = norm_rope_pair(q, kv, cos, sin, qn, kvn)
    assert torch.equal(got[1], norm_rope_torch(kv, cos, sin, norm=kvn))


def test_bad_inputs():
    x = torch.randn(3, 32)
    cos, sin = tables(3, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="cos must be"):
        norm_rope_torch(x, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="cos must be"):
        norm_rope_torch(x, *tables(3, 17, torch.float32, 0))
    with pytest.raises(TypeError, match="norm must be a NormSpec"):
        norm_rope_torch(x, cos, sin, norm=(None, 1e-6))
    with pytest.raises(ValueError, match="norm.weight"):
        norm_rope_torch(x, cos, sin, norm=NormSpec(torch.ones(31), 1e-6))
    with pytest.raises(ValueError, match="power-of-two"):
        norm_rope_triton(torch.randn(3, 48), *tables(3, 8, torch.float32, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["none", "weighted", "unweighted"])
def test_gpu_kernel_equals_torch_ops(norm):
    """On CUDA: DeepSeek-V4's shapes (512 channels, 64 rotary); the rotation alone is bit-exact
    (no fused multiply-adds), behind a norm within one bf16 ulp (the norm's sum order)."""
    gen = torch.Generator().manual_seed(7)
    for shape in ((32, 16, 512), (37, 512)):
        x = (torch.randn(*shape, generator=gen) * 2).bfloat16().cuda()
        cos, sin = (t.cuda() for t in tables(shape[0], 32, torch.bfloat16, 8))
        spec = {
            "none": None,
            "weighted": NormSpec((torch.rand(512, generator=gen) + 0.5).cuda(), 1e-6),
            "unweighted": NormSpec(None, 1e-6),
        }[norm]
        for inverse in (False, True):
            got = norm_rope_triton(x, cos, sin, norm=spec, inverse=inverse)
            want = norm_rope_torch(x, cos, sin, norm=spec, inverse=inverse)
            if spec is None:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=8e-3)


@pytest.mark.gpu
def test_gpu_pair_launch_equals_two_launches():
    """On CUDA at DeepSeek-V4's shapes (16 heads x 512, 64 rotary, bf16): the pair launch
    gives the bits of the two launches it replaces."""
    q, kv, cos, sin, w = _pair_case(13, 37, 16, 512, 32, torch.bfloat16, "cuda")
    qn, kvn = NormSpec(None, 1e-6), NormSpec(w, 1e-6)
    got_q, got_kv = norm_rope_pair(q, kv, cos, sin, qn, kvn)
    assert torch.equal(got_q, norm_rope_triton(q, cos, sin, norm=qn))
    assert torch.equal(got_kv, norm_rope_triton(kv, cos, sin, norm=kvn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads,n", [(5, 3, 6), (1, 1, 1), (4, 2, 32)])
def test_rope_and_scale_is_the_two_torch_ops(dtype, t, heads, n):
    """A DeepSeek-V4 indexer's queries (RoPE, no norm) and head weights (fp32, scaled) in one
    launch: bit for bit `norm_rope_triton` and ``v.float() * scale``; weights read through a
    column view of a wider projection, as the model hands them."""
    from kvplan.ops.rope import rope_and_scale, rope_and_scale_triton

    gen = torch.Generator().manual_seed(t * 100 + n)
    x = torch.randn(t, heads, 32, generator=gen).to(dtype)
    wide = torch.randn(t, n + 5, generator=gen).to(dtype)
    v = wide[:, 2 : 2 + n]
    cos, sin = tables(t, 8, dtype, 3)
    scale = (heads**-0.5) * (32**-0.5)
    got_x, got_v = rope_and_scale_triton(x, cos, sin, v, scale)
    assert torch.equal(got_x, norm_rope_triton(x, cos, sin))
    assert got_v.dtype == torch.float32 and torch.equal(got_v, v.float() * scale)
    want_x, want_v = rope_and_scale(x, cos, sin, v, scale)  # CPU tensors: the torch path
    assert torch.equal(want_v, got_v)
    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_x, want_x, **tol)


def test_rope_and_scale_errors():
    from kvplan.ops.rope import rope_and_scale, rope_and_scale_triton

    x = torch.randn(3, 2, 32)
    cos, sin = tables(3, 8, torch.float32, 0)
    with pytest.raises(ValueError, match=r"x \[T, H, D\] and v \[T, N\]"):
        rope_and_scale_triton(x, cos, sin, torch.randn(4, 5), 0.5)
    with pytest.raises(ValueError, match=r"unit column stride"):
        rope_and_scale(x, cos, sin, torch.randn(5, 3).t(), 0.5)
    with pytest.raises(TypeError, match="v"):
        rope_and_scale_triton(x, cos, sin, torch.ones(3, 5, dtype=torch.int32), 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
def test_gpu_rope_and_scale_is_the_two_ops(heads):
    """On CUDA at the indexer's shapes (heads x 128, 64 rotary, bf16, the weights a column
    view of the layer's wide projection): the bits of `norm_rope` and the torch product,
    with scales that are not powers of two."""
    from kvplan.ops.rope import rope_and_scale

    gen = torch.Generator().manual_seed(heads)
    t = 37
    x = torch.randn(t, heads, 128, generator=gen).bfloat16().cuda()
    wide = torch.randn(t, 3 * heads + 7, generator=gen).bfloat16().cuda()
    v = wide[:, heads + 3 : 2 * heads + 3]
    cos, sin = (c.cuda() for c in tables(t, 32, torch.bfloat16, 5))
    scale = (heads**-0.5) * (128**-0.5)
    got_x, got_v = rope_and_scale(x, cos, sin, v, scale)
    assert torch.equal(got_x, norm_rope_triton(x, cos, sin))
    assert torch.equal(got_v, v.float() * scale)
