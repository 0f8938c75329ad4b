"""The decode MoE kernels (`kvplan.ops.moe_decode`): on the CPU interpreter, with inputs whose
GEMMs are exact in fp32, they equal the five-kernel torch path bit for bit (so the SwiGLU and
the weighted sum repeat its rounding steps); on random inputs they stay within bf16 rounding
of an fp64 reference; bad input is refused naming the argument; on CUDA at the DeepSeek-V4
bench shapes they match cuBLAS's path and replay in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import sm90_stats

from kvplan.ops import moe_decode as md
from kvplan.ops.moe_dense import expert_weighted_sum, moe_swiglu

PLAN_A = md.MoeDecodePlan(32, 64, 4, 1)  # small tiles: few interpreter programs, masked edges
PLAN_B = md.MoeDecodePlan(16, 64, 4, 1)
LIMIT = 3.0


def _grid_values(shape, gen, scale):
    """Random multiples of ``scale`` in [-4, 4] * scale (bf16-exact, exact sums in fp32)."""
    return (torch.randint(-4, 5, shape, generator=gen).float() * scale).to(torch.bfloat16)


def _case(t, e, inter, hidden, router, seed, exact):
    gen = torch.Generator().manual_seed(seed)
    rows = (e + 1) * 2 * inter + router
    if exact:
        x = _grid_values((t, hidden), gen, 2**-3)
        w = _grid_values((rows, hidden), gen, 2**-4)
        down = _grid_values((e + 1, hidden, inter), gen, 2**-4)
    else:
        x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16)
        w = (torch.randn(rows, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
        down = (torch.randn(e + 1, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    dense = torch.rand(t, e, generator=gen) * (torch.rand(t, e, generator=gen) < 0.5)
    return x, w, down, dense


def _torch_path(x, w, down, dense, e, inter):
    """The five-kernel path (`DeepseekV4MoE`'s fused dense path before these kernels)."""
    out = F.linear(x, w)
    split = (e + 1) * 2 * inter
    h = moe_swiglu(out[:, :split], e + 1, LIMIT)
    y = torch.bmm(h, down.transpose(1, 2))
    return h, out[:, split:], expert_weighted_sum(y[:-1], dense, add=y[-1])


def _kernels(x, w, down, dense, e, inter, monkeypatch):
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    assert md.moe_decode_wanted(x)
    h, logits = md.moe_gate_up_swiglu(x, w, e, inter, LIMIT, PLAN_A)
    out = md.moe_down_sum(h, down, dense, PLAN_B)
    monkeypatch.delenv("KVPLAN_FORCE_TRITON")
    return h, logits, out


@pytest.mark.parametrize(
    "t, e, inter, hidden, router",
    [(1, 2, 32, 64, 2), (5, 3, 48, 96, 3), (17, 2, 40, 128, 5)],
)
def test_interpreter_equals_torch_path_bit_for_bit_on_exact_gemms(
    t, e, inter, hidden, router, monkeypatch
):
    x, w, down, dense = _case(t, e, inter, hidden, router, seed=t + 7 * e, exact=True)
    want_h, want_logits, want = _torch_path(x, w, down, dense, e, inter)
    h, logits, out = _kernels(x, w, down, dense, e, inter, monkeypatch)
    assert h.shape == (e + 1, t, inter) and logits.shape == (t, router) and out.shape == x.shape
    assert torch.equal(h, want_h)
    assert torch.equal(logits, want_logits)
    assert torch.equal(out, want)
    assert out.float().abs().max() > 0.1 and (h != 0).float().mean() > 0.5


def test_interpreter_random_inputs_within_bf16_rounding(monkeypatch):
    t, e, inter, hidden, router = 9, 3, 40, 160, 3  # H, I not multiples of the K step
    x, w, down, dense = _case(t, e, inter, hidden, router, seed=11, exact=False)
    h, logits, out = _kernels(x, w, down, dense, e, inter, monkeypatch)
    ref = F.linear(x.double(), w.double())
    split = (e + 1) * 2 * inter
    torch.testing.assert_close(logits.double(), ref[:, split:], atol=2e-2, rtol=1.6e-2)
    g, u = ref[:, :split].view(t, e + 1, 2, inter).unbind(2)
    ref_h = (F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT)).transpose(0, 1)
    torch.testing.assert_close(h.double(), ref_h, atol=2e-2, rtol=1.6e-2)
    y = torch.bmm(h.double(), down.double().transpose(1, 2))  # from the kernel's own h
    ref_out = torch.einsum("eth,te->th", y[:-1], dense.double()) + y[-1]
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=2e-2)
    assert ref_out.abs().max() > 0.3


def test_torch_fallback_and_dispatch(monkeypatch):
    monkeypatch.delenv("KVPLAN_FORCE_TRITON", raising=False)
    x, w, down, dense = _case(4, 2, 32, 64, 2, seed=3, exact=False)
    assert not md.moe_decode_wanted(x)  # CPU without the force: the torch path
    want_h, want_logits, want = _torch_path(x, w, down, dense, 2, 32)
    h, logits = md.moe_gate_up_swiglu(x, w, 2, 32, LIMIT)
    assert torch.equal(h, want_h) and torch.equal(logits, want_logits)
    assert torch.equal(md.moe_down_sum(h, down, dense), want)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    assert not md.moe_decode_wanted(x.float())  # fp32 rows stay on torch
    assert not md.moe_decode_wanted(torch.zeros(md.MAX_ROWS + 1, 64, dtype=torch.bfloat16))
    assert md.moe_decode_wanted(torch.zeros(md.MAX_ROWS, 64, dtype=torch.bfloat16))


def test_bad_input_names_the_argument():
    x, w, down, dense = _case(4, 2, 32, 64, 2, seed=5, exact=False)
    with pytest.raises(ValueError, match="x_weight has 192 rows"):
        md.moe_gate_up_swiglu(x, w[:192], 2, 32, LIMIT)
    with pytest.raises(ValueError, match="x.shape\\[1\\]=64 differs from x_weight.shape\\[1\\]=32"):
        md.moe_gate_up_swiglu(x, w[:, :32].contiguous(), 2, 32, LIMIT)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        md.moe_gate_up_swiglu(x, w, 0, 32, LIMIT)
    with pytest.raises(ValueError, match="inter must be a positive int, got True"):
        md.moe_gate_up_swiglu(x, w, 2, True, LIMIT)
    with pytest.raises(TypeError, match="x_weight must have dtype torch.bfloat16"):
        md.moe_gate_up_swiglu(x, w.float(), 2, 32, LIMIT)
    h = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match h"):
        md.moe_down_sum(h, down[:, :, :16], dense)
    with pytest.raises(ValueError, match="dense"):
        md.moe_down_sum(h, down, dense[:, :1])
    with pytest.raises(ValueError, match="at least one routed one"):
        md.moe_down_sum(h[:1], down[:1], dense[:, :0])


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_kernels_compile_for_sm90_pipelined_without_spills(which):
    """The default plans at the bench model's shapes (32 rows, K a multiple of the step):
    no spills; the gate-up kernel's 64-row weight tiles on wgmma."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "logits_ptr": "*bf16",
           "dense_ptr": "*fp32", "out_ptr": "*bf16", "limit": "fp32"}  # fmt: skip
    if which == "gate_up":
        kernel, plan, k = md.moe_gate_up_kernel, md.GATE_UP_PLAN, 2048
        extra = {}
    else:
        kernel, plan, k = md.moe_down_sum_kernel, md.DOWN_PLAN, 1024
        extra = {"NUM_EXPERTS": 16}
    consts = dict(BLOCK_M=32, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                  K_STEPS=k // plan.block_k, EVEN_K=True, UPCAST=False, **extra)  # fmt: skip
    stats = sm90_stats(kernel, consts, signature=sig, num_warps=plan.num_warps,
                       num_stages=plan.num_stages)  # fmt: skip
    assert stats.spill_bytes == 0 and stats.wgmma == (which == "gate_up")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 32, 64])
def test_cuda_bench_shapes_match_cublas_and_replay_in_a_graph(t):
    """The DeepSeek-V4 bench model's MoE (16 experts + the shared one, I = 1,024, H = 2,048)
    against the cuBLAS path within bf16 rounding; a graph replays the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    e, inter, hidden = 16, 1024, 2048
    x, w, down, dense = (v.cuda() for v in _case(t, e, inter, hidden, e, seed=t, exact=False))
    want_h, want_logits, want = _torch_path(x, w, down, dense, e, inter)
    assert md.moe_decode_wanted(x)
    h, logits = md.moe_gate_up_swiglu(x, w, e, inter, LIMIT)
    out = md.moe_down_sum(h, down, dense)
    torch.testing.assert_close(h, want_h, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(logits, want_logits, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, want, atol=3e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_h, _ = md.moe_gate_up_swiglu(x, w, e, inter, LIMIT)
        g_out = md.moe_down_sum(g_h, down, dense)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_h, h) and torch.equal(g_out, out)
