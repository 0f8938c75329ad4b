"""The interpreter's bf16 ``tl.dot`` (patched by ``tests/interpreter_bf16.py``) equals fp32
products of the same values."""

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
