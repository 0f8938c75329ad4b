"""The interpreter's bf16 ``tl.dot`` and fp32 -> bf16 cast, as ``kvplan.ops._interpreter_bf16``
fixes them: fp32 products of the same values; round to nearest even."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dot only"
)


@triton.jit
def _dot_kernel(a, b, o, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(a + r[:, None] * N + r[None, :])
    y = tl.load(b + r[:, None] * N + r[None, :])
    tl.store(o + r[:, None] * N + r[None, :], tl.dot(x, y))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreter_dot_multiplies_values(dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, out, 16)
    want = a.double() @ b.double()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@triton.jit
def _cast_kernel(x, o, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(o + r, tl.load(x + r).to(tl.bfloat16))


def test_interpreter_fp32_to_bf16_rounds_to_nearest_even():
    """Ties to even, halfway-and-above up, NaN stays NaN: torch's (and the GPU's) rounding."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=gen) * 10.0 ** torch.randint(-30, 30, (1000,), generator=gen)
    base = torch.tensor([1.0, 1.0, 1.0, -3.0], dtype=torch.float32).view(torch.int32)
    edges = (base + torch.tensor([0x8000, 0x18000, 0x7FFF, 0x8001], dtype=torch.int32)).view(
        torch.float32
    )  # 1 + half an ulp (tie -> even: 1), 1 + 1.5 ulp (tie -> 1 + 2 ulp), just below / above
    x = torch.cat([x, edges, torch.tensor([float("nan"), float("inf"), -0.0, 3.4e38])])
    x = torch.cat([x, torch.zeros(1024 - x.numel())])  # a power-of-two block
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, x.numel())
    want = x.bfloat16()
    assert torch.equal(out.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(out[fin].view(torch.int16), want[fin].view(torch.int16))
