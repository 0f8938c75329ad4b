"""DeepSeek-V4 RMSNorms: torch path == fp64 formula; Triton == torch (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvplan.ops.rms_norm import (
    rms_norm_fp32w,
    rms_norm_fp32w_torch,
    rms_norm_fp32w_triton,
    unweighted_rms_norm,
    unweighted_rms_norm_torch,
    unweighted_rms_norm_triton,
)

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tol(dtype):
    # bf16: two rounding steps, and a reduction order of its own on the GPU
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 20), (1, 100)])
def test_weighted_matches_torch(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    want = rms_norm_fp32w_torch(x, w, 1e-6)
    xd = x.double()
    ref = w.double() * xd / (xd.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(want.double(), ref, **_tol(dtype))
    got = rms_norm_fp32w_triton(x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), 1e-6)
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 20)])
def test_unweighted_matches_torch(shape, dtype):
    gen = torch.Generator().manual_seed(7 + sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    want = unweighted_rms_norm_torch(x, 1e-6)
    got = unweighted_rms_norm_triton(x.to(TRITON_DEVICE), 1e-6)
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))


def test_strided_input_and_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(6, 40, generator=gen)
    x = big[:, 4:36]  # row stride 40
    w = torch.rand(32, generator=gen) + 0.5
    want = rms_norm_fp32w_torch(x.contiguous(), w, 1e-5)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    torch.testing.assert_close(rms_norm_fp32w(x, w, 1e-5), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        unweighted_rms_norm(x.t(), 1e-5), unweighted_rms_norm_torch(x.t(), 1e-5),
        atol=1e-6, rtol=1e-6,
    )  # fmt: skip


def test_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fp32w(x, torch.ones(7), 1e-6)
    with pytest.raises(TypeError, match="x"):
        unweighted_rms_norm(x.long(), 1e-6)
