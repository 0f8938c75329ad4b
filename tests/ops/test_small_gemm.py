"""small_linear: the weight-streaming GEMM (CPU interpreter with and without split K; sm_90
compile; CUDA at decode shapes and in graphs) equals the fp32 product within bf16 rounding,
gives the same bits on every run, leaves its counters zeroed, and rejects bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import sm90_stats
from torch import nn

from kvplan.ops import small_gemm as sg


def _case(m: int, n: int, k: int, seed: int, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
    return x, w


def _check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    assert out.dtype == x.dtype and out.shape == ref.shape
    # one bf16 step of the output (the interpreter's cast truncates; the GPU's rounds to
    # nearest) on top of the fp32 sum's error
    tol = 2**-7 * ref.abs() + 1e-3 * ref.abs().max()
    assert ((out.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize(
    "m, n, k, splits",
    [(1, 64, 256, 1), (5, 70, 300, None), (16, 130, 512, 4), (33, 64, 384, 3), (64, 96, 256, 2)],
)
def test_interpreter_equals_reference(m, n, k, splits) -> None:
    x, w = _case(m, n, k, seed=m * 1000 + n)
    plan = sg.small_gemm_plan(m, n, k, 4, splits=splits)
    out = sg.small_linear_triton(x, w, plan)
    _check_close(out, x, w)
    assert torch.equal(sg.small_linear_triton(x, w, plan), out)  # the same bits again
    if plan.splits > 1:
        assert int(sg._counters[x.device].abs().sum()) == 0  # counters left zeroed


def test_strided_rows_and_split_results_agree() -> None:
    """A row-strided ``x`` (a column slice) gives the contiguous copy's result, and split-K
    plans agree with the one-split plan within fp32 summation error."""
    x, w = _case(8, 64, 512, seed=3)
    wide = torch.cat([x, x[:, :64]], dim=1)[:, :512]  # row stride 576
    assert wide.stride(0) == 576
    one = sg.small_linear_triton(x, w, sg.small_gemm_plan(8, 64, 512, 4, splits=1))
    assert torch.equal(
        sg.small_linear_triton(wide, w, sg.small_gemm_plan(8, 64, 512, 4, splits=1)), one
    )
    four = sg.small_linear_triton(x, w, sg.small_gemm_plan(8, 64, 512, 4, splits=4))
    assert (four.float() - one.float()).abs().max() <= 2**-7 * one.float().abs().max()


def test_plan() -> None:
    # llama-1b's o projection at batch 64 on 132 SMs: 32 tiles, K split in 8 (256 programs)
    p = sg.small_gemm_plan(64, 2048, 2048, 132, block_n=64, block_k=128, programs_per_sm=2)
    assert (p.block_m, p.splits, p.k_per_split) == (64, 8, 256)
    # the split count divides the K steps: 2,048 / 128 = 16 steps, a target of 5 -> 4
    p = sg.small_gemm_plan(64, 2048 * 6, 2048, 132, block_n=64, block_k=128, programs_per_sm=2)
    assert (p.splits, p.k_per_split) == (1, 2048)
    p = sg.small_gemm_plan(3, 64 * 52, 2048, 132, block_n=64, block_k=128, programs_per_sm=2)
    assert (p.block_m, p.splits) == (16, 4)
    assert sg.small_gemm_plan(1, 64, 100, 132).splits == 1  # one K step
    with pytest.raises(ValueError, match="m=65"):
        sg.small_gemm_plan(65, 64, 128, 132)


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


def test_linear_dispatch_on_cpu() -> None:
    """On CPU tensors `small_linear` / `linear` are ``F.linear`` / the module's own forward
    (biased layers and subclasses keep theirs on any device)."""
    x, w = _case(4, 64, 128, seed=2)
    assert not sg.small_linear_wanted(x, w)
    assert torch.equal(sg.small_linear(x, w), F.linear(x, w))
    lin = nn.Linear(128, 64, bias=True).to(torch.bfloat16)
    assert torch.equal(sg.linear(lin, x), lin(x))


@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_compiles_for_sm90_without_spills(splits) -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32"}  # fmt: skip
    consts = dict(BLOCK_M=64, BLOCK_N=sg.BLOCK_N, BLOCK_K=sg.BLOCK_K, SPLITS=splits, K_STEPS=4,
                  EVEN_K=True, INTERPRET=False)  # fmt: skip
    stats = sm90_stats(sg.small_linear_kernel, consts, signature=sig, num_warps=sg.NUM_WARPS,
                       num_stages=sg.NUM_STAGES)  # fmt: skip
    assert stats.spill_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n, k",
    [(64, 3072, 2048), (64, 2048, 8192), (32, 12288, 512), (7, 1000, 2000), (64, 129280, 2048)],
)
def test_cuda_decode_shapes(m, n, k) -> None:
    x, w = _case(m, n, k, seed=n, device="cuda")
    out = sg.small_linear(x, w)
    assert sg.small_linear_wanted(x, w)
    _check_close(out.cpu(), x.cpu(), w.cpu())
    for _ in range(5):  # split K: the same bits whichever program arrives last
        assert torch.equal(sg.small_linear(x, w), out)


@pytest.mark.gpu
def test_cuda_graph_replay() -> None:
    x, w = _case(64, 2048, 2048, seed=5, device="cuda")
    plan = sg.small_gemm_plan(
        64, 2048, 2048, torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert plan.splits > 1
    eager = sg.small_linear_triton(x, w, plan)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sg.small_linear_triton(x, w, plan)
    for _ in range(3):
        x.copy_(torch.randn_like(x.float()).to(x.dtype))
        g.replay()
        assert torch.equal(out, sg.small_linear_triton(x, w, plan))
    assert not torch.equal(out, eager)
