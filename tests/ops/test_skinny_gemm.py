"""Split-K GEMM for decode-sized row counts (`kvplan.ops.skinny_gemm`): against a float64
reference (interpreter on CPU, fp32 and bf16), deterministic, plans and errors, the models'
dispatch (`linear`) and the Llama model with the switch on, sm_90 compiles without spills."""

from __future__ import annotations

import pytest
import torch

import kvplan.ops.skinny_gemm as sg
from kvplan.models.config import named_config
from kvplan.ops._skinny_gemm_kernels import skinny_gemm_kernel
from kvplan.ops.skinny_gemm import SkinnyTiles, linear, skinny_linear, skinny_plan
from tests.models.fused_testlib import model_with_random_weights
from tests.sm90_compile import sm90_stats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed, m, n, k, dtype, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    return x, w, b, want


CASES = [  # (m, n, k, tiles): one split (direct), several, K not a multiple of the tiles
    (1, 33, 70, None),
    (17, 64, 256, SkinnyTiles(16, 32, 3, 4, 1)),
    (64, 100, 96, None),
    (5, 48, 512, SkinnyTiles(32, 64, None, 4, 1)),
    (3, 16, 32, SkinnyTiles(16, 32, 1, 4, 1)),
    (9, 40, 200, SkinnyTiles(16, 32, 4, 4, 1)),
]


@pytest.mark.parametrize("m, n, k, tiles", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_equals_float64_reference(m, n, k, tiles, bias):
    x, w, b, want = _case(m + n + k, m, n, k, torch.float32, bias)
    got = skinny_linear(x, w, b, tiles=tiles)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    assert torch.equal(got, skinny_linear(x, w, b, tiles=tiles))  # the same bits every run


@pytest.mark.parametrize("m, n, k, tiles", CASES[2:4])
def test_bf16_rounds_once(m, n, k, tiles):
    """bf16 in, fp32 sums, one rounding: within one bf16 ulp of the exact result rounded."""
    x, w, b, want = _case(m * n, m, n, k, torch.bfloat16)
    got = skinny_linear(x, w, b, tiles=tiles).double()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp(min=1e-3)
    assert ((got - want.bfloat16().double()).abs() <= ulp).all()


def test_splits_change_only_the_order_of_the_sums():
    x, w, b, want = _case(3, 24, 80, 384, torch.float32)
    results = [skinny_linear(x, w, b, tiles=SkinnyTiles(16, 32, s, 4, 1)) for s in (1, 2, 5, 12)]
    for r in results:
        torch.testing.assert_close(r.double(), want, atol=2e-5 * want.abs().max().item(), rtol=0)


def test_plan():
    tiles = SkinnyTiles(64, 128)
    # 2,048 x 3,072 on 132 SMs: 48 column tiles -> 5 splits wanted; 16 K tiles in runs of 4
    assert skinny_plan(3072, 2048, 132, tiles)[1:] == (4, 4)
    assert skinny_plan(128, 64, 132, tiles)[1:] == (1, 1)  # one K tile: one split
    assert skinny_plan(64, 4096, 132, SkinnyTiles(64, 128, 7))[1:] == (7, 5)  # 32 tiles / 7
    assert skinny_plan(64, 256, 132, SkinnyTiles(64, 128, 9))[1:] == (2, 1)  # at most K tiles


def test_errors_name_the_field():
    x, w, b, _ = _case(0, 4, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="x must have 1..64 rows"):
        skinny_linear(torch.zeros(65, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="x must have 1..64 rows"):
        skinny_linear(x[:0], w)
    with pytest.raises(TypeError, match="weight"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x, w[:, :16])
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:3])
    with pytest.raises(TypeError, match="tiles"):
        skinny_linear(x, w, tiles=(64, 128))
    for bad in (dict(block_n=48), dict(block_k=8), dict(splits=0), dict(num_warps=3),
                dict(num_stages=0)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SkinnyTiles(**bad)


def test_linear_dispatch(monkeypatch):
    layer = torch.nn.Linear(32, 8).to(DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    calls = []
    real = sg.skinny_linear
    monkeypatch.setattr(sg, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.delenv(sg.ENV_SWITCH, raising=False)
    linear(layer, x, fused=True)  # switch off (the default)
    monkeypatch.setenv(sg.ENV_SWITCH, "1")
    linear(layer, x, fused=False)  # the model runs its torch path
    linear(layer, torch.randn(65, 32, device=DEVICE), fused=True)  # too many rows
    assert calls == []
    got = linear(layer, x, fused=True)
    assert calls == [1]
    torch.testing.assert_close(got, layer(x), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv(sg.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match=sg.ENV_SWITCH):
        linear(layer, x, fused=True)


def test_llama_with_skinny_projections_equals_torch_path(monkeypatch):
    """Every projection of a decode-sized forward on the split-K kernels (interpreter):
    the logits of the torch path within fp32 rounding."""
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    cfg = named_config("tiny-llama", num_layers=2)
    model = model_with_random_weights(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    ids, pos = ids.to(DEVICE), torch.arange(6, device=DEVICE)
    model.fused_kernels = True
    monkeypatch.delenv(sg.ENV_SWITCH, raising=False)
    want = model(ids, pos, None)
    calls = []
    real = sg.skinny_linear
    monkeypatch.setattr(sg, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(sg.ENV_SWITCH, "1")
    got = model(ids, pos, None)
    assert len(calls) == 4 * cfg.num_layers  # qkv, o, gate_up, down per layer
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---- sm_90 compiles ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m_p, block_n, block_k, warps, stages",
    [(64, 64, 128, 4, 3), (32, 128, 64, 4, 4), (16, 64, 256, 8, 3)],
)
def test_bf16_kernel_compiles_for_sm90_without_spills(m_p, block_n, block_k, warps, stages):
    const = dict(M_P=m_p, BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=4, EVEN_K=True,
                 DIRECT=False, HAS_BIAS=False, DOT_PRECISION="tf32", UPCAST=False)  # fmt: skip
    st = sm90_stats(skinny_gemm_kernel, const, ptr_dtype="*bf16", num_warps=warps,
                    num_stages=stages, signature={"out_ptr": "*fp32"},
                    div16={"x_ptr", "w_ptr", "bias_ptr", "out_ptr", "K", "N", "stride_xm"})  # fmt: skip
    assert st.spill_bytes == 0, st
    assert st.cp_async, "K loop loads not software-pipelined"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 32, 64])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)])
def test_gpu_bf16_against_cublas(m, n, k):
    """At llama-1b's projection shapes: within one bf16 ulp of float64-exact, as cuBLAS."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    want = (x.double() @ w.double().T).bfloat16().double()
    got = skinny_linear(x, w).double()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp(min=1e-3)
    assert ((got - want).abs() <= ulp).all()
    assert torch.equal(skinny_linear(x, w), skinny_linear(x, w))


def test_deepseek_v4_linear_group_takes_the_switch(monkeypatch):
    """A fused `LinearGroup` of decode rows runs one split-K GEMM with the switch on, the
    members' outputs of the torch GEMM within fp32 rounding."""
    from kvplan.models.deepseek_v4.layers import LinearGroup

    g = torch.Generator().manual_seed(5)
    a, b = torch.nn.Linear(64, 24, bias=False), torch.nn.Linear(64, 40, bias=False)
    for m in (a, b):
        m.weight.data = torch.randn(m.weight.shape, generator=g)
    group = LinearGroup(a.to(DEVICE), b.to(DEVICE))
    group.fuse()
    x = torch.randn(6, 64, generator=g).to(DEVICE)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.delenv(sg.ENV_SWITCH, raising=False)
    want = group(x)
    calls = []
    real = sg.skinny_linear
    monkeypatch.setattr(sg, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(sg.ENV_SWITCH, "1")
    got = group(x)
    assert calls == [1] and [t.shape for t in got] == [(6, 24), (6, 40)]
    for y, w in zip(got, want):
        torch.testing.assert_close(y, w, atol=1e-4, rtol=1e-5)
