"""fp8 / int8 / fp4 KV caches in the dense engine: pages read in place == dequantize-then-attend.

The oracle is the same engine with a bf16 cache whose store first rounds K/V through the
format's quantize + dequantize (``kvplan.quant``, bf16 in and out): it holds exactly the
values the quantized cache decodes to, and its attention reads them with the same bf16 query,
so logits and greedy tokens must be identical (CPU: torch paths). On the GPU the quantized
engine also runs decode steps in CUDA graphs, which must equal its eager steps.
"""

from __future__ import annotations

import pytest
import torch

from kvplan import LLM, SamplingParams, quant
from kvplan.cache.kv_tensors import KVCacheTensors
from kvplan.engine.scoring import prompt_logits
from kvplan.models.config import named_config

CFG = named_config("tiny-llama", head_dim_override=64, num_heads=4, num_kv_heads=2,
                   hidden_size=128)  # fmt: skip


def _engine(kv_format: str, **kw) -> LLM:
    kw = dict(device="cpu", backend="block_offsets", block_size=4, max_model_len=96,
              num_blocks=80, enable_prefix_caching=False) | kw  # fmt: skip
    return LLM(CFG, kv_format=kv_format, **kw)


def _rounding_store(kv_cache, layout):
    """Wrap ``kv_cache.store`` (a bf16 cache) to store K/V rounded through ``layout``."""
    store = kv_cache.store

    def rounded(x):
        flat = x.to(torch.bfloat16).reshape(x.shape[0], -1)  # [T, Hkv * D]
        return quant.dequantize(*quant.quantize(flat, layout), layout).view(x.shape)

    def wrapped(layer, k, v, slot_mapping, *, check=True):
        return store(layer, rounded(k), rounded(v), slot_mapping, check=check)

    return wrapped


def _oracle(kv_format: str, **kw) -> LLM:
    layout = KVCacheTensors(1, 2, 4, CFG.num_kv_heads, CFG.head_dim, kv_format=kv_format).layout
    llm = _engine("bf16", **kw)
    llm.parts.kv_cache.store = _rounding_store(llm.parts.kv_cache, layout)
    return llm


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, CFG.vocab_size, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "fp4"])
@pytest.mark.parametrize("backend", ["block_offsets", "ragged"])
def test_greedy_tokens_equal_dequantize_then_attend(kv_format, backend):
    prompts = _prompts(5, seed=1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = _engine(kv_format, backend=backend, max_num_batched_tokens=32)
    assert got.parts.kv_cache.is_quantized and got.parts.kv_cache.kv_format == kv_format
    want = _oracle(kv_format, backend=backend, max_num_batched_tokens=32)
    outs = [[o.token_ids for o in llm.generate(prompts, params)] for llm in (got, want)]
    assert outs[0] == outs[1]


def test_async_scheduling_with_fp8_gives_the_same_tokens():
    prompts = _prompts(4, seed=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = []
    for flag in (False, True):
        llm = _engine("fp8", async_scheduling=flag)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "fp4"])
def test_teacher_forced_logits_equal_dequantize_then_attend(kv_format):
    ids = _prompts(1, seed=2)[0] * 2
    got = prompt_logits(_engine(kv_format).engine, ids, 8)
    want = prompt_logits(_oracle(kv_format).engine, ids, 8)
    assert torch.equal(got, want)
    exact = prompt_logits(_engine("fp32").engine, ids, 8)
    assert not torch.equal(got, exact)  # the format does round


def test_fp4_cache_is_smaller_than_fp8():
    fp8, fp4 = (_engine(f).parts.kv_cache for f in ("fp8", "fp4"))
    assert fp4.raw_k_cache(0).shape[-1] == 2 * 64 // 2 + 2 * 64 // 16  # values + e4m3 scales
    assert fp8.raw_k_cache(0).shape[-1] == 2 * 64 + 2 * 64 // 32 * 4  # values + fp32 scales


def test_int8_cache_rounds_differently_from_fp8():
    """Same record size as fp8, other values: the int8 engine is not the fp8 one renamed."""
    ids = _prompts(1, seed=2)[0] * 2
    i8, f8 = (_engine(f) for f in ("int8", "fp8"))
    assert i8.parts.kv_cache.raw_k_cache(0).shape == f8.parts.kv_cache.raw_k_cache(0).shape
    assert i8.parts.kv_cache.layout.quantized_dtype == "int8"
    assert not torch.equal(prompt_logits(i8.engine, ids, 8), prompt_logits(f8.engine, ids, 8))


def _eager_and_graph_tokens(kv_format: str, **kw):
    """Greedy tokens of 11 prompts x 24 new tokens on CUDA (fp32 weights) with eager decode
    steps and with CUDA graphs: ``(eager, graphs, the graph engine's DecodeGraphs)``; ``kw``:
    more engine settings."""
    prompts = _prompts(11, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = _engine(kv_format, device="cuda", dtype="float32", max_num_seqs=16,
                      use_cuda_graph=graphs, num_blocks=400, block_size=16, **kw)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    return outs[False], outs[True], llm.engine.runner.graphs


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8", "int8", "fp4"])
def test_gpu_graphs_with_quantized_cache_match_eager(kv_format):
    """Quantized caches are captured in CUDA graphs; replays give the eager tokens."""
    eager, replayed, g = _eager_and_graph_tokens(kv_format)
    assert g is not None
    assert g.num_replays > 0
    assert replayed == eager


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format, drafts", [("fp8", 0), ("fp4", 0), ("fp8", 3)])
def test_gpu_graphs_with_an_exact_window_match_eager(kv_format, drafts):
    """``kv_exact_window``: the ring's step arrays are persistent buffers the graphs read
    (11 rows in a 16-row bucket: padding rows read no ring key and write the trash row);
    replays give the eager tokens, also with n-gram drafts (verification rows bounded by
    their own windows)."""
    eager, replayed, g = _eager_and_graph_tokens(kv_format, kv_exact_window=12,
                                                 num_speculative_tokens=drafts)  # fmt: skip
    assert g is not None and g.recent is not None
    assert g.num_replays > 0
    assert replayed == eager


@pytest.mark.gpu
def test_gpu_fp8_graph_context_tiers_match_eager(monkeypatch):
    """fp8 decode graphs captured per context tier (`DECODE_HEADS_AUTO`'s bound lowered to 32
    keys, so rows cross it mid-decode): short steps replay the tier graph (one KV head a
    program), long ones the ``max_model_len`` graph (two), and the tokens equal eager steps,
    whose launches take the same heads by each step's own length."""
    import kvplan.ops._paged_attention_kernels as pak

    monkeypatch.setattr(pak, "DECODE_HEADS", None)
    monkeypatch.setattr(pak, "DECODE_HEADS_AUTO", {"e4m3": (2, 32)})
    monkeypatch.setattr(pak, "DECODE_HEADS_MIN_PROGRAMS", 1)  # any batch of this small model
    eager, replayed, g = _eager_and_graph_tokens("fp8")
    assert g is not None and g.tiers == [32, 96]
    assert 0 < g.tier_replays < g.num_replays
    assert replayed == eager


@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_engine_with_prefetching_paged_kernels_gives_the_same_logits(kv_format, monkeypatch):
    """The engine on the Triton paged kernels (interpreter) with ``QUANT_PREFETCH``: each
    whole tile's bytes loaded a step ahead, the logits of the same engine without it."""
    import kvplan.ops._paged_attention_kernels as pak

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    # the plain scale rule: the prefetch reads whatever the pages hold, and the searched
    # stores of 90 rows take most of the interpreter's time
    monkeypatch.setenv("KVPLAN_KV_SCALE_SEARCH", "0")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (90,), generator=g).tolist()  # whole 64-key tiles
    want = prompt_logits(_engine(kv_format).engine, ids, 16)
    calls = []
    real = pak._ahead_step  # one call per whole tile the prefetching loop attends
    monkeypatch.setattr(pak, "QUANT_PREFETCH", 1)
    monkeypatch.setattr(pak, "_ahead_step", lambda *a: calls.append(a[-2]) or real(*a))
    got = prompt_logits(_engine(kv_format).engine, ids, 16)
    # a[-2]: the step's MODE (V_GROUPS follows)
    assert calls and set(calls) == {1} and torch.equal(got, want)


@pytest.mark.parametrize("nib", [False, True])
def test_engine_decode_on_fp4_f16_tiles(nib, monkeypatch):
    """A bf16 engine's decode steps on the Triton paged kernels (interpreter) with fp4 pages
    read as fp16 tiles (``FP4_F16_TILES``; in nibble order with ``FP4_NIBBLE_TILES``): the
    decode launches take ``E2M1_F16`` / ``E2M1_F16_NIB`` and the greedy tokens equal the
    bf16 tiles' (the keys' values are the same; the probabilities round to fp16 instead of
    bf16), their logprobs within 0.02."""
    import kvplan.ops._paged_attention_kernels as pak

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setenv("KVPLAN_KV_SCALE_SEARCH", "0")  # the tiles read any stored scales
    kinds = []
    real = pak._kv_quant
    monkeypatch.setattr(pak, "_kv_quant", lambda *a: kinds.append(real(*a)) or kinds[-1])
    monkeypatch.setattr(pak, "FP4_NIBBLE_TILES", nib)
    prompts = _prompts(3, seed=8)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(pak, "FP4_F16_TILES", on)
        outs.append(_engine("fp4", dtype="bfloat16").generate(prompts, params))
        assert set(kinds) == ({pak.E2M1_F16_NIB if nib else pak.E2M1_F16} if on else {2})
        kinds.clear()
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < 0.02


def test_engine_decode_with_heads_side_by_side(monkeypatch):
    """A bf16 engine's decode steps on the Triton paged kernels (interpreter) over fp8 pages
    (CFG: 2 KV heads) with ``KVPLAN_DECODE_HEADS=2`` and ``KVPLAN_DECODE_HEADS_FIRST=1`` (the
    module switches): the decode grids hold one program a (KV-head pair, sequence) in
    KV-head-first order, and the greedy tokens equal the default launches', their logprobs
    within 0.02."""
    import kvplan.ops._paged_attention_kernels as pak

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setenv("KVPLAN_KV_SCALE_SEARCH", "0")
    grids = []
    kernel = pak._decode_kernel

    class Spy:  # records each decode launch's grid
        def __getitem__(self, grid):
            grids.append(grid[:2])
            return kernel[grid]

    monkeypatch.setattr(pak, "_decode_kernel", Spy())
    prompts = _prompts(3, seed=9)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    outs = []
    for heads, first in ((None, False), (2, True)):
        monkeypatch.setattr(pak, "DECODE_HEADS", heads)
        monkeypatch.setattr(pak, "DECODE_HEADS_FIRST", first)
        outs.append(_engine("fp8", dtype="bfloat16").generate(prompts, params))
        if first:  # one KV-head pair, then the sequences
            assert grids and all(g[0] == 1 for g in grids)
        else:  # the sequences, then the 2 KV heads
            assert grids and all(g[1] == 2 for g in grids)
        grids.clear()
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < 0.02
