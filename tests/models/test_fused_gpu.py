"""Fused model kernels on CUDA: the agreement `kvplan.models.fused` claims, and the model.

* ``silu_and_mul`` and ``qkv_epilogue`` without q/k norm: bit-exact with the torch path for
  fp32, bf16 and fp16;
* ``rms_norm``: the residual sum bit-exact, the output at most 2 ulp apart (the weight multiply
  can turn a 1-ulp difference of the normed value into 2) and almost always equal; the q/k norm
  inside ``qkv_epilogue`` likewise;
* the whole model fused vs unfused (bf16: same greedy argmax where the margin is clear; fp32:
  same greedy tokens through the engine), inside a CUDA graph, and through the engine's graphs.
"""

from __future__ import annotations

import random

import pytest
import torch
from fused_testlib import gen, model_with_random_weights, qkv_case, randn

from kvplan.models import fused
from kvplan.models.config import named_config
from kvplan.models.llama import FUSED_KERNELS_ENV

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in units in the last place (same-sign values; 0 for equal)."""
    ia, ib = (x.view(_BITS[x.dtype]).long() for x in (a, b))
    same_sign = (a >= 0) == (b >= 0)
    return torch.where(same_sign, (ia - ib).abs(), torch.full_like(ia, 1 << 30))


def _assert_near_exact(got, want, max_ulp, min_equal=0.99, msg=""):
    dist = _ulp_distance(got, want)
    dist = torch.where(got == want, 0, dist)  # +0 == -0
    assert int(dist.max()) <= max_ulp, f"{msg}: {int(dist.max())} ulp apart"
    assert float((dist == 0).float().mean()) >= min_equal, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t, inter", [(1, 8192), (64, 8192), (7, 96)])
def test_silu_and_mul_bit_exact(dtype, t, inter):
    gate_up = randn(gen(t), t, 2 * inter, dtype=dtype, device="cuda", scale=4.0)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -17.0], dtype=dtype)
    assert torch.equal(fused.silu_and_mul_triton(gate_up), fused.silu_and_mul_torch(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t, n", [(1, 2048), (64, 2048), (300, 2048), (5, 96)])
def test_rms_norm_residual_exact_output_within_2_ulp(dtype, t, n):
    g = gen(n + t)
    x, res = (randn(g, t, n, dtype=dtype, device="cuda", scale=2.0) for _ in range(2))
    w = randn(g, n, dtype=dtype, device="cuda")
    r1, r2 = res.clone(), res.clone()
    got = fused.rms_norm_triton(x, w, 1e-5, r1)
    want = fused.rms_norm_torch(x, w, 1e-5, r2)
    assert torch.equal(r1, r2), "residual sum"
    for msg, a, b in (
        ("norm with residual", got, want),
        ("norm", fused.rms_norm_triton(x, w, 1e-5), fused.rms_norm_torch(x, w, 1e-5)),
    ):
        if dtype == torch.float32:  # no coarse rounding to hide the reduction order
            torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-6, msg=msg)
        else:
            _assert_near_exact(a, b, 2, msg=msg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 64, 257])
def test_qkv_epilogue_without_norm_bit_exact(dtype, d, t):
    args, kw = qkv_case(t + d, t, 32, 8, d, False, dtype=dtype, device="cuda", max_pos=4096)
    got, want = fused.qkv_epilogue_triton(*args, **kw), fused.qkv_epilogue_torch(*args, **kw)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.is_contiguous(), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "int8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("t", [1, 64, 300])
def test_qkv_epilogue_store_bytes_equal_the_cache_store(kv_format, dtype, t):
    """The fused K/V store on the GPU (hardware fp8 conversion, fast fp32-scale division)
    leaves the cache bytes ``KVCacheTensors.store`` leaves, at the engine's head shape."""
    from kvplan.cache.kv_tensors import KVCacheTensors

    h, hkv, d = 32, 8, 64
    args, kw = qkv_case(t + 3, t, h, hkv, d, False, dtype=dtype, device="cuda", max_pos=512)
    g = gen(t)
    slots = torch.randperm(64 * 16, generator=g)[:t].cuda()
    slots[::7] = -1
    caches = [KVCacheTensors(1, num_blocks=64, block_size=16, num_kv_heads=hkv, head_dim=d,
                             kv_format=kv_format, device="cuda") for _ in range(2)]  # fmt: skip
    q, k, v = fused.qkv_epilogue_triton(*args, **kw)
    caches[0].store(0, k, v, slots, check=False)
    c = caches[1]
    if kv_format == "bf16":
        store = (c.k_cache(0), c.v_cache(0), slots)
    else:
        store = (c.raw_k_cache(0), c.raw_v_cache(0), slots, c.layout)
    got = fused.qkv_epilogue_triton(*args, **kw, kv_store=store)
    for a, b in zip(got, (q, k, v), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(c.raw_k_cache(0), caches[0].raw_k_cache(0))
    assert torch.equal(c.raw_v_cache(0), caches[0].raw_v_cache(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_qkv_epilogue_with_qk_norm_near_exact(dtype, d):
    args, kw = qkv_case(d, 33, 16, 4, d, True, dtype=dtype, device="cuda", max_pos=4096)
    got, want = fused.qkv_epilogue_triton(*args, **kw), fused.qkv_epilogue_torch(*args, **kw)
    assert torch.equal(got[2], want[2]), "v"
    eps = torch.finfo(dtype).eps
    for name, a, b in zip("qk", got[:2], want[:2]):
        # a 1-ulp difference of a normed value moves the rotated sum by about one ulp of the
        # larger product term, which may be several ulp of a small (cancelled) sum
        bound = 3 * eps * float(b.abs().max())
        torch.testing.assert_close(a.float(), b.float(), atol=bound, rtol=0, msg=name)
        if dtype != torch.float32:
            assert float((a == b).float().mean()) >= 0.98, name


GPU_CONFIGS = {
    "llama-d64": named_config("tiny-llama", hidden_size=256, num_heads=4, num_kv_heads=2,
                              head_dim_override=64, intermediate_size=512),
    "qwen3-d128": named_config("tiny-llama", hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim_override=128, intermediate_size=512, qk_norm=True,
                               qkv_bias=True),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_model_fused_vs_unfused_bf16(name):
    cfg = GPU_CONFIGS[name]
    model = model_with_random_weights(cfg, seed=4, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=gen(5)).cuda()
    pos = torch.arange(37, device="cuda")
    assert model.fused_kernels is None  # fused on CUDA
    got = model(ids, pos, None)
    model.fused_kernels = False
    want = model(ids, pos, None)
    scale = float(want.abs().max())
    # bf16 vs fp32 differ by ~1.3% of the scale here (CPU estimate); fused vs unfused by less
    torch.testing.assert_close(got, want, atol=0.03 * scale, rtol=0)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.04 * scale
    assert int(clear.sum()) >= 10
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_fused_model_in_cuda_graph_equals_eager():
    cfg = GPU_CONFIGS["qwen3-d128"]
    model = model_with_random_weights(
        cfg, seed=6, dtype=torch.bfloat16, device="cuda", fused_kernels=True
    )
    ids = torch.randint(0, cfg.vocab_size, (8,), generator=gen(7)).cuda()
    pos = torch.arange(8, device="cuda")
    eager = model(ids, pos, None)  # compiles the kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(ids, pos, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(ids, pos, None)
    ids.copy_(torch.randint(0, cfg.vocab_size, (8,), generator=gen(8)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, model(ids, pos, None))
    assert not torch.equal(out, eager)


def test_engine_fused_equals_unfused_fp32_and_captures_graphs(monkeypatch):
    from kvplan import LLM, SamplingParams

    cfg = GPU_CONFIGS["llama-d64"]
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(FUSED_KERNELS_ENV, value)
        llm = LLM(cfg, device="cuda", dtype="float32", backend="block_offsets",
                  max_model_len=128, num_blocks=300)  # fmt: skip
        assert llm.engine.runner.model.fused_kernels is (value == "1")
        assert llm.engine.runner.graphs is not None, "CUDA graph capture failed"
        outs[value] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["1"] == outs["0"]
    monkeypatch.setenv(FUSED_KERNELS_ENV, "1")
    llm = LLM(cfg, device="cuda", backend="block_offsets", max_model_len=128, num_blocks=300)
    assert llm.engine.runner.graphs is not None, "bf16 CUDA graph capture failed"
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [24] * 6
