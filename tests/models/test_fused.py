"""Fused model kernels (`kvplan.models.fused`): Triton == torch path == independent reference.

Each kernel on tiny fp32 shapes (few programs) under the Triton interpreter on CPU, or on the
GPU when there is one; the fused model against the unfused one; sm_90 compiles. GPU (``gpu`` marker): bf16/fp16 kernels against
the torch path with the agreement the module docstring claims (bit-exact or 1 ulp), the whole
model fused vs unfused, inside a CUDA graph, and through the engine.
"""

from __future__ import annotations

import pytest
import torch
from fused_testlib import (
    DEVICE,
    DenseCausal,
    gen,
    model_with_random_weights,
    norm_ref,
    qkv_case,
    randn,
    rope_ref,
)
from sm90_compile import compile_sm90

from kvplan.models import _fused_kernels as kernels
from kvplan.models import fused
from kvplan.models.config import named_config
from kvplan.models.llama import FUSED_KERNELS_ENV, LlamaForCausalLM

# --- interpreter: each kernel on fp32 --------------------------------------------------------


@pytest.mark.parametrize("t, n", [(5, 48), (1, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_fp32(t, n, with_residual):
    g = gen(t * n)
    x, w, res = randn(g, t, n, scale=3.0), randn(g, n), randn(g, t, n)
    res_torch, res_triton = res.clone(), res.clone()
    want = fused.rms_norm_torch(x, w, 1e-6, res_torch if with_residual else None)
    got = fused.rms_norm_triton(x, w, 1e-6, res_triton if with_residual else None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    h = x + res if with_residual else x
    torch.testing.assert_close(got.double(), norm_ref(h, w, 1e-6), atol=1e-5, rtol=1e-5)
    if with_residual:  # the sum is written back in place, bit-exactly
        assert torch.equal(res_triton, x + res) and torch.equal(res_torch, x + res)
    else:
        assert torch.equal(res_triton, res)


def test_rms_norm_3d_and_strided_rows():
    g = gen(1)
    x3 = randn(g, 3, 2, 16)  # per-head norm input [T, n, D]
    w = randn(g, 16)
    torch.testing.assert_close(fused.rms_norm_triton(x3, w, 1e-6),
                               fused.rms_norm_torch(x3, w, 1e-6), atol=1e-6, rtol=1e-6)  # fmt: skip
    wide = randn(g, 3, 40)
    x, res = wide[:, :16], randn(g, 3, 16)  # x rows with a row stride of 40
    r1, r2 = res.clone(), res.clone()
    torch.testing.assert_close(fused.rms_norm_triton(x, w, 1e-6, r1),
                               fused.rms_norm_torch(x, w, 1e-6, r2), atol=1e-6, rtol=1e-6)  # fmt: skip
    assert torch.equal(r1, r2)
    with pytest.raises(ValueError, match="residual must be viewable"):
        fused.rms_norm_triton(x3, w, 1e-6, randn(g, 2, 3, 16).transpose(0, 1))
    with pytest.raises(ValueError, match="residual must match"):
        fused.rms_norm_triton(x, w, 1e-6, randn(g, 4, 16))
    with pytest.raises(TypeError, match="weight must be"):
        fused.rms_norm_triton(x, w.double(), 1e-6)


@pytest.mark.parametrize(
    "t, h, hkv, d, norm, tile_h",
    [(3, 4, 2, 16, False, None), (5, 4, 2, 16, True, 2), (2, 2, 1, 24, True, None),
     (1, 2, 2, 64, False, 4)],
)  # fmt: skip
def test_qkv_epilogue_kernel_fp32(t, h, hkv, d, norm, tile_h):
    args, kw = qkv_case(t * d + h, t, h, hkv, d, norm)
    want = fused.qkv_epilogue_torch(*args, **kw)
    got = fused.qkv_epilogue_triton(*args, **kw, tile_h=tile_h)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.is_contiguous() and a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    # independent reference: per-head norm (float64), pairwise rotation
    qkv, pos, cos, sin = args
    x = qkv.view(t, h + 2 * hkv, d)
    q, k, v = x[:, :h], x[:, h : h + hkv], x[:, h + hkv :]
    if norm:
        q, k = norm_ref(q, kw["q_norm_weight"], 1e-5), norm_ref(k, kw["k_norm_weight"], 1e-5)
    for a, b in zip(got, (rope_ref(q, cos[pos], sin[pos]), rope_ref(k, cos[pos], sin[pos]), v)):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "int8", "fp4"])
@pytest.mark.parametrize(
    "dtype, norm, tile_h", [(torch.float32, False, None), (torch.bfloat16, True, 2)]
)
def test_qkv_epilogue_store_writes_what_the_cache_store_writes(kv_format, dtype, norm, tile_h):
    """``kv_store``: the kernel (and the torch path) leave a `KVCacheTensors` cache (bf16, or
    fp8 / int8 token records) byte for byte as its own ``store`` of the returned k / v does,
    non-finite values included; skipped slots (-1, past the end) and every other slot keep
    their bytes; q / k / v are those of the call without a store."""
    from kvplan.cache.kv_tensors import KVCacheTensors

    t, h, hkv, d = 6, 4, 2, 32
    args, kw = qkv_case(11 + int(norm), t, h, hkv, d, norm, dtype=dtype)
    kw["eps"] = 1e-5 if norm else 1e-6
    qkv = args[0]
    qkv[3, (h + hkv) * d + 5] = float("inf")  # a v value of token 3 (stored at slot 9)
    qkv[3, (h + hkv + 1) * d + 7] = float("nan")
    qkv[2, (h + hkv) * d + 1] = -float("inf")
    slots = torch.tensor([3, -1, 17, 9, 20, 0], device=DEVICE)  # 20 = 5 blocks x 4: skipped

    def caches():
        kv = KVCacheTensors(1, num_blocks=5, block_size=4, num_kv_heads=hkv, head_dim=d,
                            kv_format=kv_format, device=DEVICE)  # fmt: skip
        for c in (kv.raw_k_cache(0), kv.raw_v_cache(0)):  # random old contents
            c.copy_(torch.randint(0, 127, c.shape, generator=gen(5), dtype=torch.uint8))
        return kv

    def target(kv):
        if kv_format == "bf16":
            return kv.k_cache(0), kv.v_cache(0), slots
        return kv.raw_k_cache(0), kv.raw_v_cache(0), slots, kv.layout

    for fn, extra in ((fused.qkv_epilogue_triton, {"tile_h": tile_h}),
                      (fused.qkv_epilogue_torch, {})):  # fmt: skip
        plain = fn(*args, **kw, **extra)
        want = caches()
        want.store(0, plain[1], plain[2], slots, check=False)
        kv = caches()
        before = kv.raw_k_cache(0).clone()
        got = fn(*args, **kw, **extra, kv_store=target(kv))
        for name, a, b in zip("qkv", got, plain, strict=True):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name
        assert torch.equal(kv.raw_k_cache(0), want.raw_k_cache(0)), fn.__name__
        if kv_format == "bf16":  # the same values; a NaN's payload bits are not specified
            assert torch.equal(kv.v_cache(0).isnan(), want.v_cache(0).isnan())
            assert torch.equal(kv.v_cache(0).nan_to_num(7.0), want.v_cache(0).nan_to_num(7.0))
        else:  # NaN -> +0 by the quantization rule: the same bytes
            assert torch.equal(kv.raw_v_cache(0), want.raw_v_cache(0)), fn.__name__
        assert not torch.equal(kv.raw_k_cache(0), before)  # the store wrote something
    kv = caches()
    store = target(kv)
    with pytest.raises(ValueError, match="kv_store slots"):
        fused.qkv_epilogue_triton(*args, **kw, kv_store=(*store[:2], slots[:3], *store[3:]))
    with pytest.raises(ValueError, match="kv_store k_cache must be"):
        fused.qkv_epilogue_triton(*args, **kw, kv_store=(store[0][..., :8], *store[1:]))
    with pytest.raises(ValueError, match="kv_store caches differ"):
        fused.qkv_epilogue_torch(*args, **kw, kv_store=(store[0], store[1][:3], *store[2:]))
    with pytest.raises(TypeError, match="kv_store must be"):
        fused.qkv_epilogue_triton(*args, **kw, kv_store=store[:2])


def test_fused_store_refuses_formats_it_does_not_write():
    from kvplan.cache.kv_tensors import KVCacheTensors

    args, kw = qkv_case(3, 2, 2, 1, 48, False)  # head_dim 48: not a power of two
    kv = KVCacheTensors(1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=48,
                        kv_format="fp4", device=DEVICE)  # fmt: skip
    assert not fused.fused_store_supports(kv.layout, 48)
    store = (kv.raw_k_cache(0), kv.raw_v_cache(0), torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="not one the fused store writes"):
        fused.qkv_epilogue_triton(*args, **kw, kv_store=(*store, kv.layout))
    fp8 = KVCacheTensors(1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=32,
                         kv_format="fp8", device=DEVICE)  # fmt: skip
    assert fused.fused_store_supports(fp8.layout, 32)
    assert not fused.fused_store_supports(fp8.layout, 48)
    fp4 = KVCacheTensors(1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=32,
                         kv_format="fp4", device=DEVICE)  # fmt: skip
    assert fused.fused_store_supports(fp4.layout, 32)


@pytest.mark.parametrize(
    "backend, kv_format",
    [(b, "bf16") for b in ("vanilla", "ragged", "block_offsets")]
    + [("block_offsets", f) for f in ("fp8", "int8", "fp4")],
)
def test_engine_fused_store_equals_the_backend_store(monkeypatch, backend, kv_format):
    """The engine with fused kernels writes K/V in the qkv epilogue (the backend's store is
    never called) and generates the tokens of the unfused engine, whose backend stores them:
    bf16 caches on the three paged backends, fp8 / int8 / fp4 records (fp8 and fp4 with
    searched scales: the epilogue's search picks the store kernel's scales). The A/B switch
    that turns the fused store off is checked on the bf16 caches (a searched store takes ~7x
    the interpreter's time of a plain one; the quantized cases run the two engines that
    differ)."""
    from kvplan import LLM, SamplingParams
    from kvplan.cache.kv_tensors import KVCacheTensors

    cfg = named_config("tiny-llama", num_layers=2, head_dim_override=32)  # fp8 groups of 32
    prompts = [[5, 9, 2, 7, 1], [11, 4, 6, 2, 9, 10, 1]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    calls = []
    real_store = KVCacheTensors.store
    monkeypatch.setattr(
        KVCacheTensors, "store", lambda self, *a, **k: (calls.append(1), real_store(self, *a, **k))
    )
    outs = {}
    # unfused kernels; fused kernels; fused kernels with the store switched off (A/B runs)
    settings = (("0", "1"), ("1", "1")) + ((("1", "0"),) if kv_format == "bf16" else ())
    for value, store in settings:
        monkeypatch.setenv(FUSED_KERNELS_ENV, value)
        monkeypatch.setenv("KVPLAN_FUSED_KV_STORE", store)
        calls.clear()
        llm = LLM(cfg, device=DEVICE, dtype="float32", kv_format=kv_format,
                  backend=backend, max_model_len=32, num_blocks=16, seed=0)  # fmt: skip
        outs[value + store] = [o.token_ids for o in llm.generate(prompts, params)]
        fused_store = value == "1" and store == "1"
        assert (len(calls) == 0) == fused_store, (value, store)
    assert outs["11"] == outs["01"] == outs.get("10", outs["01"])


def test_qkv_epilogue_bad_positions_poison_and_caller_errors():
    args, kw = qkv_case(7, 3, 2, 1, 16, False, max_pos=8)
    qkv, pos, cos, sin = args
    bad = torch.tensor([8, 2, -1], device=DEVICE)
    q, k, v = fused.qkv_epilogue_triton(qkv, bad, cos, sin, **kw)
    assert q[0].isnan().all() and k[2].isnan().all() and not q[1].isnan().any()
    assert torch.equal(v, qkv.view(3, 4, 16)[:, 3:])  # v is copied whatever the position
    with pytest.raises(ValueError, match="qkv must be"):
        fused.qkv_epilogue_triton(qkv[:, :-1], pos, cos, sin, **kw)
    with pytest.raises(ValueError, match="positions must be"):
        fused.qkv_epilogue_triton(qkv, pos[:2], cos, sin, **kw)
    with pytest.raises(ValueError, match="sin must be"):
        fused.qkv_epilogue_triton(qkv, pos, cos, sin[:, :8], **kw)
    with pytest.raises(ValueError, match="given together"):
        fused.qkv_epilogue_triton(qkv, pos, cos, sin, q_norm_weight=cos[0], **kw)


@pytest.mark.parametrize("t, inter, tile", [(3, 40, None), (4, 48, 16), (1, 8, None)])
def test_silu_and_mul_kernel_fp32(t, inter, tile):
    gate_up = randn(gen(inter), t, 2 * inter, scale=4.0)
    got = fused.silu_and_mul_triton(gate_up, tile=tile)
    torch.testing.assert_close(got, fused.silu_and_mul_torch(gate_up), atol=1e-6, rtol=1e-6)
    g, u = gate_up.double()[:, :inter], gate_up.double()[:, inter:]
    torch.testing.assert_close(got.double(), g * torch.sigmoid(g) * u, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gate_up must be"):
        fused.silu_and_mul_triton(gate_up[:, :-1])


def test_kernels_bf16_within_rounding():
    """Runs the bf16 code paths (bf16 intermediates in their own summation order: a few ulp
    apart)."""
    bf = torch.bfloat16
    args, kw = qkv_case(3, 3, 2, 1, 16, True, dtype=bf)
    for a, b in zip(fused.qkv_epilogue_triton(*args, **kw), fused.qkv_epilogue_torch(*args, **kw)):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.03)
    g = gen(5)
    x, w, res = randn(g, 3, 32, dtype=bf), randn(g, 32, dtype=bf), randn(g, 3, 32, dtype=bf)
    r1, r2 = res.clone(), res.clone()
    torch.testing.assert_close(fused.rms_norm_triton(x, w, 1e-6, r1).float(),
                               fused.rms_norm_torch(x, w, 1e-6, r2).float(), atol=0.05, rtol=0.03)  # fmt: skip
    torch.testing.assert_close(r1.float(), r2.float(), atol=0.0, rtol=2**-7)
    gu = randn(g, 2, 32, dtype=bf, scale=3.0)
    torch.testing.assert_close(fused.silu_and_mul_triton(gu).float(),
                               fused.silu_and_mul_torch(gu).float(), atol=0.02, rtol=0.02)  # fmt: skip


def test_dispatch_follows_fused_flag(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "silu_and_mul_triton", lambda gu: calls.append("triton"))
    monkeypatch.setattr(fused, "silu_and_mul_torch", lambda gu: calls.append("torch"))
    gu = torch.zeros(1, 4)
    fused.silu_and_mul(gu)  # CPU tensor, fused=None -> torch
    fused.silu_and_mul(gu, fused=True)
    fused.silu_and_mul(gu, fused=False)
    assert calls == ["torch", "triton", "torch"]


# --- sm_90 compiles ---------------------------------------------------------------------------

_F32_ARGS = {"eps": "fp32", "inv_n": "fp32", "inv_d": "fp32"}
# qkv_epilogue_kernel's quantized-store constexprs at their plain-cache values
_PLAIN = dict(QUANT=0, GS=1, QMAX=1.0, SF=2, SB=4, HW=True, FAST_DIV=False, SEARCH=False, PARTS=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90(dtype):
    ptr = f"*{dtype}"
    compile_sm90(kernels.rms_norm_kernel, ptr, _F32_ARGS, HAS_RESIDUAL=True, TILE_N=2048, PARTS=0)
    compile_sm90(kernels.rms_norm_kernel, ptr, _F32_ARGS, HAS_RESIDUAL=False, TILE_N=128, PARTS=0)
    for norm in (False, True):
        compile_sm90(kernels.qkv_epilogue_kernel, ptr, {**_F32_ARGS, "pos_ptr": "*i64"},
                     NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, QK_NORM=norm, TILE_H=8,
                     TILE_D=128, STORE=False, BLOCK_SIZE=1, **_PLAIN)  # fmt: skip
    compile_sm90(kernels.qkv_epilogue_kernel, ptr, {**_F32_ARGS, "pos_ptr": "*i32"},
                 NUM_HEADS=4, NUM_KV_HEADS=2, HEAD_DIM=80, QK_NORM=True, TILE_H=8, TILE_D=128,
                 STORE=False, BLOCK_SIZE=1, **_PLAIN)  # fmt: skip
    # the fused K/V store into a bf16 cache (the engine's decode: llama-1b heads, 16-token blocks)
    compile_sm90(kernels.qkv_epilogue_kernel, ptr,
                 {**_F32_ARGS, "pos_ptr": "*i64", "slot_ptr": "*i64", "kc_ptr": "*bf16",
                  "vc_ptr": "*bf16", "stride_cb": "i64"},
                 NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, QK_NORM=False, TILE_H=16,
                 TILE_D=64, STORE=True, BLOCK_SIZE=16, **_PLAIN)  # fmt: skip
    # ... and into fp8 / int8 token records (fp32 scales per 32 values; fp8: searched or not)
    for quant, qmax, search in ((1, 448.0, True), (1, 448.0, False), (3, 127.0, False)):
        compile_sm90(kernels.qkv_epilogue_kernel, ptr,
                     {**_F32_ARGS, "pos_ptr": "*i64", "slot_ptr": "*i64", "kc_ptr": "*u8",
                      "vc_ptr": "*u8", "stride_cb": "i64"},
                     NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, QK_NORM=False, TILE_H=16,
                     TILE_D=64, STORE=True, BLOCK_SIZE=16, QUANT=quant, GS=32, QMAX=qmax, SF=2,
                     SB=4, HW=True, FAST_DIV=True, SEARCH=search, PARTS=0)  # fmt: skip
    compile_sm90(kernels.silu_and_mul_kernel, ptr, TILE=1024, EXACT=True)


# --- the model, fused vs unfused --------------------------------------------------------------


CPU_CONFIGS = {
    "llama": named_config("tiny-llama", num_layers=2),
    "qwen3": named_config("tiny-llama", num_layers=1, qk_norm=True, qkv_bias=True),
}


@pytest.mark.parametrize("name", sorted(CPU_CONFIGS))
def test_fused_model_equals_unfused_fp32(name):
    cfg = CPU_CONFIGS[name]
    model = model_with_random_weights(cfg, seed=1)
    assert model.fused_kernels is None
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=gen(2)).to(DEVICE)
    pos = torch.arange(7, device=DEVICE)
    auto = model(ids, pos, None)  # fused_kernels=None: kernels on CUDA, torch path on CPU
    model.fused_kernels = False
    want = model(ids, pos, None)
    model.fused_kernels = True
    got = model(ids, pos, None)
    assert torch.equal(auto, got if DEVICE == "cuda" else want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([6, 2], device=DEVICE)
    torch.testing.assert_close(model(ids, pos, None, rows), want[rows], atol=1e-5, rtol=1e-5)


def test_fused_kernels_env_default(monkeypatch):
    cfg = CPU_CONFIGS["llama"]
    for value, want in (("0", False), ("1", True), ("", None)):
        monkeypatch.setenv(FUSED_KERNELS_ENV, value)
        assert LlamaForCausalLM(cfg, DenseCausal, max_positions=8).fused_kernels is want
    assert (
        LlamaForCausalLM(cfg, DenseCausal, max_positions=8, fused_kernels=False).fused_kernels
        is False
    )
    monkeypatch.setenv(FUSED_KERNELS_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_KERNELS_ENV):
        LlamaForCausalLM(cfg, DenseCausal, max_positions=8)
