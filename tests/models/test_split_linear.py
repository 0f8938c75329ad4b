"""Split-K projections (`kvplan.models.fused.split_linear`) added up by the norm after them.

Interpreter / CPU: the partials against per-slice fp32 products, `SplitSums.total` against an
explicit in-order sum, `rms_norm` of partials (kernel == torch path, the residual bit for bit),
the model with splits against the model without, bad input. GPU (``gpu`` marker): the batched
GEMM's partials and the norm over them against ``F.linear`` and the plain norm, and the fp32
model's greedy tokens with and without splits through the engine's CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_testlib import DEVICE, DenseCausal, gen, model_with_random_weights, qkv_case, randn
from sm90_compile import compile_sm90

import kvplan.ops.split_linear as split_rule
from kvplan.models import _fused_kernels as kernels
from kvplan.models import fused
from kvplan.models.config import named_config
from kvplan.models.llama import DEFAULT_LINEAR_SPLITS, SPLIT_LINEAR_ENV, LlamaForCausalLM


def _slices_ref(x, w, s):
    """The S partial products in float64, one K slice each: [S, T, N]."""
    k = x.shape[1] // s
    return torch.stack([x[:, i * k:(i + 1) * k].double() @ w[:, i * k:(i + 1) * k].double().T
                        for i in range(s)])  # fmt: skip


@pytest.mark.parametrize("t, n, k, s", [(5, 48, 64, 4), (1, 16, 32, 1), (3, 24, 96, 3)])
def test_split_linear_partials_are_the_slice_products(t, n, k, s):
    g = gen(t * n + s)
    x, w = randn(g, t, k), randn(g, n, k)
    got = fused.split_linear(x, w, s)
    assert got.sums.shape == (s, t, n) and got.sums.dtype == torch.float32
    assert got.shape == (t, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.sums.double(), _slices_ref(x, w, s), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.total(), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_total_sums_in_order_then_rounds():
    g = gen(3)
    big, small = randn(g, 4, 8, device="cpu") * 1e8, randn(g, 4, 8, device="cpu")
    sums = torch.stack((big, small, -big))  # in order, big + small loses small's low bits
    got = fused.SplitSums(sums, torch.bfloat16).total()
    want = ((big + small) - big).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, small.to(torch.bfloat16))  # what (big - big) + small gives
    rows = fused.SplitSums(sums, torch.float32).rows(torch.tensor([3, 1]))
    assert torch.equal(rows.sums, sums[:, [3, 1]])


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_partials_kernel_equals_torch_path(parts, with_residual, dtype):
    g = gen(parts + 7 * with_residual)
    t, n = 5, 48
    sums = fused.SplitSums(randn(g, parts, t, n, scale=2.0), dtype)
    w = randn(g, n, dtype=dtype)
    res = randn(g, t, n, dtype=dtype)
    r1, r2 = res.clone(), res.clone()
    got = fused.rms_norm_triton(sums, w, 1e-6, r1 if with_residual else None)
    want = fused.rms_norm_torch(sums, w, 1e-6, r2 if with_residual else None)
    assert got.dtype == dtype and got.shape == (t, n)
    assert torch.equal(r1, r2)  # the residual sum, bit for bit (the same roundings)
    if with_residual:
        assert torch.equal(r1, res + sums.total())
    else:
        assert torch.equal(r1, res)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the dispatcher: partials on the kernel's device follow ``fused``
    torch.testing.assert_close(fused.rms_norm(sums, w, 1e-6, fused=False), want if not
                               with_residual else fused.rms_norm_torch(sums, w, 1e-6))  # fmt: skip


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("dtype, norm", [(torch.float32, False), (torch.bfloat16, True)])
def test_qkv_epilogue_of_partials_equals_epilogue_of_their_total(parts, dtype, norm):
    """The kernel over the partials (and the torch path) gives what it gives for the rounded
    total, q / k / v and the bf16 cache it stores into, bit for bit."""
    from kvplan.cache.kv_tensors import KVCacheTensors

    t, h, hkv, d = 5, 4, 2, 16
    args, kw = qkv_case(parts + 3 * norm, t, h, hkv, d, norm, dtype=dtype)
    g = gen(parts)
    sums = fused.SplitSums(randn(g, parts, t, (h + 2 * hkv) * d, scale=2.0), dtype)
    slots = torch.tensor([3, -1, 17, 9, 0], device=DEVICE)
    outs = []
    for qkv, fn in ((sums, fused.qkv_epilogue_triton), (sums.total(), fused.qkv_epilogue_triton),
                    (sums, fused.qkv_epilogue_torch)):  # fmt: skip
        kv = KVCacheTensors(1, num_blocks=5, block_size=4, num_kv_heads=hkv, head_dim=d,
                            kv_format="bf16", device=DEVICE)  # fmt: skip
        got = fn(qkv, *args[1:], **kw, kv_store=(kv.k_cache(0), kv.v_cache(0), slots))
        outs.append((*got, kv.k_cache(0).clone(), kv.v_cache(0).clone()))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(outs[0], outs[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # the dispatcher sends partials on the kernels' device to the kernel
    q = fused.qkv_epilogue(sums, *args[1:], **kw, fused=True)[0]
    assert torch.equal(q, outs[0][0])


def test_split_linear_and_partials_refuse_bad_input():
    g = gen(9)
    x, w = randn(g, 4, 64), randn(g, 16, 64)
    with pytest.raises(ValueError, match="splits must be an int >= 1 dividing K = 64, got 3"):
        fused.split_linear(x, w, 3)
    with pytest.raises(ValueError, match="splits"):
        fused.split_linear(x, w, 0)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        fused.split_linear(x, randn(g, 64, 16).T, 2)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        fused.split_linear(x, randn(g, 16, 32), 2)
    with pytest.raises(TypeError, match="weight"):
        fused.split_linear(x, w.double(), 2)
    with pytest.raises(TypeError, match="sums"):
        fused.SplitSums(torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="sums"):
        fused.SplitSums(torch.zeros(2, 4, 3).transpose(1, 2), torch.float32)
    with pytest.raises(TypeError, match="weight must be"):
        fused.rms_norm_triton(fused.SplitSums(torch.zeros(2, 3, 4), torch.bfloat16),
                              torch.ones(4), 1e-6)  # fmt: skip


def test_linear_splits_rule():
    low, high = split_rule.SPLIT_LINEAR_ROWS
    big = split_rule.SPLIT_LINEAR_MIN_WEIGHT // 2048
    assert fused.linear_splits(0, 64, 2048, big) == 0
    assert fused.linear_splits(4, 64, 2048, big) == 4
    assert fused.linear_splits(3, 64, 2048, big) == 0  # does not divide K
    assert fused.linear_splits(4, low, 2048, big) == fused.linear_splits(4, high, 2048, big) == 4
    assert fused.linear_splits(4, high + 1, 2048, big) == 0  # prefill-sized
    assert fused.linear_splits(4, low - 1, 2048, big) == 0
    assert fused.linear_splits(4, 64, 2048, big - 1) == 0  # a small weight


def test_model_with_splits_equals_model_without(monkeypatch):
    """The fused model (kernels under the interpreter on CPU) with qkv / o / down split
    against the plain GEMMs: the same logits to fp32 rounding, for all rows and a subset."""
    cfg = named_config("tiny-llama", num_layers=2)
    model = model_with_random_weights(cfg, seed=4, fused_kernels=True)
    assert model.linear_splits == DEFAULT_LINEAR_SPLITS == {"qkv": 0, "o": 2, "down": 2}
    monkeypatch.setattr(split_rule, "SPLIT_LINEAR_ROWS", (1, 8))  # this test's 6 rows split,
    monkeypatch.setattr(split_rule, "SPLIT_LINEAR_MIN_WEIGHT", 0)  # and its tiny weights
    calls = []
    split_linear = fused.split_linear
    monkeypatch.setattr(fused, "split_linear", lambda x, w, s: calls.append(s) or
                        split_linear(x, w, s))  # fmt: skip
    model.set_linear_splits(0)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=gen(5)).to(DEVICE)
    pos = torch.arange(6, device=DEVICE)
    rows = torch.tensor([5, 1], device=DEVICE)
    want, want_rows = model(ids, pos, None), model(ids, pos, None, rows)
    assert calls == []
    for splits, per_layer in ((2, [2, 2, 2]), (4, [4, 4, 4]), ({"qkv": 2}, [2]),
                              ({"o": 4, "down": 2}, [4, 2])):  # fmt: skip
        model.set_linear_splits(splits)
        attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
        assert model.linear_splits == {"qkv": attn.qkv_splits, "o": attn.o_splits,
                                       "down": mlp.down_splits}  # fmt: skip
        calls.clear()
        torch.testing.assert_close(model(ids, pos, None), want, atol=1e-5, rtol=1e-5)
        assert calls == per_layer * cfg.num_layers  # the split path ran
        torch.testing.assert_close(model(ids, pos, None, rows), want_rows, atol=1e-5, rtol=1e-5)
    assert model.linear_splits == {"qkv": 0, "o": 4, "down": 2}
    model.fused_kernels = False  # the torch path never splits
    model.set_linear_splits(2)
    calls.clear()
    model(ids, pos, None)
    assert calls == []
    with pytest.raises(ValueError, match=r"linear_splits\['qkv'\] must be an int >= 0, got -1"):
        model.set_linear_splits(-1)
    with pytest.raises(ValueError, match="linear_splits names \\['up'\\]"):
        model.set_linear_splits({"up": 2})
    for env, want_splits in (("4", dict.fromkeys(("qkv", "o", "down"), 4)),
                             ("o=2, down=8", {"qkv": 0, "o": 2, "down": 8})):  # fmt: skip
        monkeypatch.setenv(SPLIT_LINEAR_ENV, env)
        assert LlamaForCausalLM(cfg, DenseCausal, max_positions=8).linear_splits == want_splits
    built = LlamaForCausalLM(cfg, DenseCausal, max_positions=8, linear_splits=0)
    assert set(built.linear_splits.values()) == {0}
    monkeypatch.setenv(SPLIT_LINEAR_ENV, "")
    assert (
        LlamaForCausalLM(cfg, DenseCausal, max_positions=8).linear_splits == DEFAULT_LINEAR_SPLITS
    )
    for bad in ("two", "o=x", "o"):
        monkeypatch.setenv(SPLIT_LINEAR_ENV, bad)
        with pytest.raises(ValueError, match=SPLIT_LINEAR_ENV):
            LlamaForCausalLM(cfg, DenseCausal, max_positions=8)


def test_partials_kernels_compile_for_sm90():
    compile_sm90(kernels.rms_norm_kernel, "*bf16", {"x_ptr": "*fp32", "eps": "fp32",
                 "inv_n": "fp32"}, HAS_RESIDUAL=True, TILE_N=2048, PARTS=4)  # fmt: skip
    # llama-1b's decode epilogue: the fused bf16 store, partials of the qkv projection
    compile_sm90(kernels.qkv_epilogue_kernel, "*bf16",
                 {"qkv_ptr": "*fp32", "eps": "fp32", "inv_d": "fp32", "pos_ptr": "*i64",
                  "slot_ptr": "*i64", "stride_cb": "i64"},
                 NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, QK_NORM=False, TILE_H=16,
                 TILE_D=64, STORE=True, BLOCK_SIZE=16, QUANT=0, GS=1, QMAX=1.0, SF=2, SB=4,
                 HW=True, FAST_DIV=False, SEARCH=False, PARTS=2)  # fmt: skip


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t, n, k", [(64, 2048, 2048), (16, 2048, 8192), (200, 96, 128)])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_split_linear_gpu_matches_linear_and_norm(t, n, k, s):
    g = gen(t + s)
    x = randn(g, t, k, dtype=torch.bfloat16, device="cuda")
    w = randn(g, n, k, dtype=torch.bfloat16, device="cuda", scale=k**-0.5)
    nw = randn(g, n, dtype=torch.bfloat16, device="cuda")
    res = randn(g, t, n, dtype=torch.bfloat16, device="cuda")
    parts = fused.split_linear(x, w, s)
    ref = _slices_ref(x, w, s)
    torch.testing.assert_close(parts.sums.double(), ref, atol=1e-4, rtol=1e-4)
    # the output the norm sees: the fp32 sum rounded once, as cuBLAS's own reduction rounds it
    lin = F.linear(x, w)
    total = parts.total()
    assert float((total == lin).float().mean()) > 0.98
    torch.testing.assert_close(total.float(), lin.float(), atol=1e-4, rtol=2**-7)
    r1, r2 = res.clone(), res.clone()
    got = fused.rms_norm_triton(parts, nw, 1e-5, r1)
    want = fused.rms_norm_torch(total, nw, 1e-5, r2)
    assert torch.equal(r1, r2)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=2**-6)


@pytest.mark.gpu
def test_engine_greedy_tokens_with_and_without_splits(monkeypatch):
    """fp32 random llama through the engine (CUDA graphs for the decode steps): the greedy
    tokens with qkv / o / down split in 4 (`KVPLAN_SPLIT_LINEAR`) equal those of the plain GEMMs,
    and a bf16 engine with splits captures its graphs and runs."""
    import random

    from kvplan import LLM, SamplingParams

    cfg = named_config("tiny-llama", hidden_size=256, num_heads=4, num_kv_heads=2,
                       head_dim_override=64, intermediate_size=512)  # fmt: skip
    rng = random.Random(1)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    monkeypatch.setattr(split_rule, "SPLIT_LINEAR_ROWS", (1, 256))  # these 6 sequences split too,
    monkeypatch.setattr(split_rule, "SPLIT_LINEAR_MIN_WEIGHT", 0)  # with their small weights
    outs = {}
    for value in ("0", "4"):
        monkeypatch.setenv(SPLIT_LINEAR_ENV, value)
        llm = LLM(cfg, device="cuda", dtype="float32", backend="block_offsets",
                  max_model_len=128, num_blocks=300)  # fmt: skip
        assert set(llm.engine.runner.model.linear_splits.values()) == {int(value)}
        assert llm.engine.runner.graphs is not None, "CUDA graph capture failed"
        outs[value] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["4"] == outs["0"]
    llm = LLM(cfg, device="cuda", backend="block_offsets", max_model_len=128, num_blocks=300)
    assert set(llm.engine.runner.model.linear_splits.values()) == {4}
    assert llm.engine.runner.graphs is not None, "bf16 CUDA graph capture failed"
    assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [24] * 6
