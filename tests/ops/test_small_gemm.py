"""small_linear: the few-row GEMM (CPU interpreter; sm_90 compile; CUDA at LM-head shapes, in
graphs) equals the fp32 product within bf16 rounding, and rejects bad input clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import sm90_stats

from kvplan.ops import small_gemm as sg


def _case(m: int, n: int, k: int, seed: int, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
    return x, w


def _check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    assert out.dtype == x.dtype and out.shape == ref.shape
    # half a bf16 step of the output (rounded to nearest, on the GPU and in the interpreter
    # with kvplan.ops._interpreter_bf16) on top of the fp32 sum's error
    tol = 2**-8 * ref.abs() + 1e-5 * ref.abs().max()
    assert ((out.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("m, n, k", [(1, 64, 256), (5, 70, 300), (16, 130, 512), (33, 256, 384)])
def test_interpreter_equals_reference(m, n, k) -> None:
    x, w = _case(m, n, k, seed=m * 1000 + n)
    out = sg.small_linear_triton(x, w, sg.small_gemm_plan(m, block_n=64, block_k=128))
    _check_close(out, x, w)


def test_strided_rows_and_tiles() -> None:
    """A row-strided ``x`` (a column slice) gives the contiguous copy's result; a narrower
    K step gives the same values within fp32 summation error."""
    x, w = _case(8, 64, 512, seed=3)
    wide = torch.cat([x, x[:, :64]], dim=1)[:, :512]  # row stride 576
    assert wide.stride(0) == 576
    plan = sg.small_gemm_plan(8, block_n=32, block_k=128)
    one = sg.small_linear_triton(x, w, plan)
    assert torch.equal(sg.small_linear_triton(wide, w, plan), one)
    other = sg.small_linear_triton(x, w, sg.small_gemm_plan(8, block_n=64, block_k=64))
    assert (other.float() - one.float()).abs().max() <= 2**-7 * one.float().abs().max()


def test_plan_and_dispatch_rule() -> None:
    assert sg.small_gemm_plan(3).block_m == 16
    assert sg.small_gemm_plan(33).block_m == 64
    with pytest.raises(ValueError, match="m=65"):
        sg.small_gemm_plan(65)
    x, w = _case(4, sg.MIN_N, 64, seed=4)
    assert not sg.small_linear_wanted(x, w)  # CPU tensors: F.linear
    assert torch.equal(sg.small_linear(x, w), F.linear(x, w))


def test_bad_input() -> None:
    x, w = _case(4, 64, 128, seed=1)
    with pytest.raises(ValueError, match="x.shape\\[1\\]=128 differs from weight.shape\\[1\\]=64"):
        sg.small_linear_triton(x, w[:, :64].contiguous())
    with pytest.raises(ValueError, match="x is torch.bfloat16, weight torch.float32"):
        sg.small_linear_triton(x, w.float())
    with pytest.raises(ValueError, match="K dimension must be contiguous"):
        sg.small_linear_triton(x.T.contiguous().T, w)
    with pytest.raises(ValueError, match="must be \\[M, K\\]"):
        sg.small_linear_triton(x[None], w)


def test_kernel_compiles_for_sm90_without_spills() -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    consts = dict(BLOCK_M=64, BLOCK_N=sg.BLOCK_N, BLOCK_K=sg.BLOCK_K, K_STEPS=16, EVEN_K=True)
    stats = sm90_stats(sg.small_linear_kernel, consts, signature=sig, num_warps=sg.NUM_WARPS,
                       num_stages=sg.NUM_STAGES)  # fmt: skip
    assert stats.spill_bytes == 0 and stats.wgmma


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(64, 128256, 2048), (32, 129280, 2048), (64, 262144, 640)])
def test_cuda_lm_head_shapes(m, n, k) -> None:
    x, w = _case(m, n, k, seed=n, device="cuda")
    assert sg.small_linear_wanted(x, w)
    out = sg.small_linear(x, w)
    _check_close(out.cpu(), x.cpu(), w.cpu())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = sg.small_linear(x, w)
    g.replay()
    assert torch.equal(replayed, out)


@pytest.mark.gpu
def test_cuda_small_heads_stay_on_cublas() -> None:
    """SmolLM2's head (49,152 x 576: below ``MIN_WEIGHT``) goes to cuBLAS; the kernel itself
    is still right on it (K = 576: nine 64-wide steps)."""
    x, w = _case(64, 49152, 576, seed=9, device="cuda")
    assert not sg.small_linear_wanted(x, w)
    _check_close(sg.small_linear_triton(x, w).cpu(), x.cpu(), w.cpu())
