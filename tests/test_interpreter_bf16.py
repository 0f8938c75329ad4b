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


@triton.jit
def _arith_kernel(x, y, o, c, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(x + r)
    b = tl.load(y + r)
    tl.store(o + r, a * b)
    tl.store(o + N + r, a + b)
    tl.store(o + 2 * N + r, a - b)
    tl.store(o + 3 * N + r, a / b)
    tl.store(o + 4 * N + r, tl.maximum(a, b))
    tl.store(o + 5 * N + r, tl.minimum(a, b))
    tl.store(c + r, (a < b).to(tl.int8))
    tl.store(c + N + r, (a >= b).to(tl.int8))


def test_interpreter_bf16_elementwise_ops_compute_values():
    """bf16 * + - / max min and compares on two bf16 operands: torch's bf16 results (fp32
    math rounded to nearest even); the interpreter alone computed on the raw bits."""
    gen = torch.Generator().manual_seed(2)
    n = 256
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 8, (n,), generator=gen)
    y = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 8, (n,), generator=gen)
    x, y = x.bfloat16(), y.bfloat16()
    y[:8] = x[:8]  # some equal pairs for the compares
    out = torch.empty(6 * n, dtype=torch.bfloat16)
    cmp = torch.empty(2 * n, dtype=torch.int8)
    _arith_kernel[(1,)](x, y, out, cmp, n)
    want = torch.cat([x * y, x + y, x - y, x / y, torch.maximum(x, y), torch.minimum(x, y)])
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(cmp, torch.cat([x < y, x >= y]).to(torch.int8))
