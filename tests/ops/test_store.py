"""store_kv_cache: Triton (interpreter on CPU, bit-exact on GPU), torch path and per-element
reference write identical bytes for every format, and only the bytes of the named slots."""

import pytest
import torch
from ops_testlib import ENGINE_FP8, ODD_FORMATS, all_formats
from ops_testlib import ids as _ids

from kvplan.formats import (
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    SUPPORTED_KV_CACHE_FORMATS,
    V41_FORMAT,
    KVCacheFormat,
    alloc_kv_cache,
    bf16_format,
    split_kv_cache,
)
from kvplan.ops.store import (
    store_kv_cache,
    store_kv_cache_ref,
    store_kv_cache_torch,
    store_kv_cache_triton,
)

ODD_FORMATS = [f for f in ODD_FORMATS if f.note != "index, 5 ue8m0 scales"]
# the dense engine's int8 format, and int8 with a partial last group (non-flat kernel path)
ENGINE_INT8 = KVCacheFormat("int8", 2 * 64, 32, 0, True, "fp32", "engine int8 2x64", True)
INT8_ODD = KVCacheFormat("int8", 40, 24, 0, True, "fp32", "int8 partial last group", True)
# searched fp32 scales with a partial last group (the kernel's non-flat path)
SEARCH_ODD = KVCacheFormat("e4m3", 40, 24, 0, True, "fp32", "searched partial group", True, True)
# fp4 with searched e4m3 scales: the engine's fp4 K (2 heads x 64) and odd groups (non-flat)
ENGINE_FP4 = KVCacheFormat("e2m1", 128, 16, 0, True, "e4m3", "engine fp4 K", True, True)
SEARCH_FP4_ODD = KVCacheFormat("e2m1", 24, 6, 0, True, "e4m3", "searched fp4 odd", True, True)
ALL_FORMATS = [
    *all_formats(ODD_FORMATS),
    ENGINE_INT8,
    INT8_ODD,
    SEARCH_ODD,
    ENGINE_FP4,
    SEARCH_FP4_ODD,
]


def _random_cache(layout, num_blocks, block_size, seed=0, device="cpu"):
    """A cache whose backing storage (padding included) holds random bytes."""
    cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
    g = torch.Generator().manual_seed(seed)
    storage = _storage(cache)
    storage.copy_(torch.randint(0, 256, storage.shape, generator=g, dtype=torch.uint8))
    return cache


def _storage(cache):
    return torch.as_strided(cache, (cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def _random_kv(n, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, layout.elements, generator=g)
    x = x * torch.exp2(torch.empty(n, 1).uniform_(-8, 8, generator=g))
    if n > 2:
        x[1] = 0  # all-zero groups must give finite scales
    return x.bfloat16()


def _random_slots(n, num_slots, seed=0, num_skip=2):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:n].to(torch.int32)
    slots[torch.randperm(n, generator=g)[:num_skip]] = -1
    return slots


@pytest.mark.parametrize("block_size", [4, 7, 133])
@pytest.mark.parametrize("layout", ALL_FORMATS, ids=_ids)
def test_triton_torch_and_reference_write_the_same_bytes(layout, block_size):
    n, num_blocks = 9, 3
    kv = _random_kv(n, layout, seed=block_size)
    slots = _random_slots(n, num_blocks * block_size, seed=block_size)
    results = []
    for fn in (store_kv_cache_ref, store_kv_cache_torch, store_kv_cache_triton):
        cache = _random_cache(layout, num_blocks, block_size)
        fn(kv, cache, slots, layout=layout)
        results.append(_storage(cache).clone())
    untouched = _storage(_random_cache(layout, num_blocks, block_size))
    assert torch.equal(results[1], results[0])
    assert torch.equal(results[2], results[0])
    # only the records of written slots changed
    bpt = layout.bytes_per_token
    changed = results[0] != untouched
    for slot in range(num_blocks * block_size):
        block, off = divmod(slot, block_size)
        if slot in slots.tolist():
            continue
        if layout.token_interleaved:
            assert not changed[block, off * bpt : (off + 1) * bpt].any()
    assert not changed[:, block_size * bpt :].any()  # block padding


def test_public_entry_flattens_heads_and_skips_minus_one():
    layout = ENGINE_FP8
    kv = _random_kv(5, layout).view(5, 2, 64)
    slots = torch.tensor([3, -1, 0, 9, -1], dtype=torch.int32)
    a = _random_cache(layout, 3, 4)
    b = _random_cache(layout, 3, 4)
    store_kv_cache(kv, a, slots, layout=layout)
    store_kv_cache_ref(kv.reshape(5, -1), b, slots, layout=layout)
    assert torch.equal(_storage(a), _storage(b))


def test_empty_input_is_a_no_op():
    cache = _random_cache(V41_FORMAT, 2, 4)
    before = _storage(cache).clone()
    empty = torch.empty(0, 512, dtype=torch.bfloat16)
    store_kv_cache(empty, cache, torch.empty(0, dtype=torch.int32))
    store_kv_cache_triton(empty, cache, torch.empty(0, dtype=torch.int32))
    assert torch.equal(_storage(cache), before)


def test_shared_padding_slot_is_deterministic():
    layout = V41_FORMAT
    kv = _random_kv(4, layout)
    slots = torch.tensor([0, 0, 5, 0], dtype=torch.int32)
    outs = []
    for fn in (store_kv_cache_ref, store_kv_cache_torch):
        cache = _random_cache(layout, 2, 4)
        fn(kv, cache, slots, layout=layout)
        outs.append(_storage(cache).clone())
    first_only = _random_cache(layout, 2, 4)
    store_kv_cache_ref(kv[[0, 2]], first_only, torch.tensor([0, 5], dtype=torch.int32))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _storage(first_only))


def test_bfloat16_cache_is_a_plain_copy():
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    kv = _random_kv(3, bf16_format(8))
    store_kv_cache(kv, cache, torch.tensor([5, -1, 0], dtype=torch.int32))
    assert torch.equal(cache[1, 1, 0], kv[0]) and torch.equal(cache[0, 0, 0], kv[2])
    assert cache.view(-1, 8).count_nonzero(dim=1).gt(0).sum() == 2


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(slots=[0, 8]), ValueError, "slot_mapping"),
        (dict(slots=[-2, 0]), ValueError, "slot_mapping"),
        (dict(slot_dtype=torch.int64), TypeError, "slot_mapping"),
        (dict(kv_dtype=torch.float32), TypeError, "kv"),
        (dict(elements=256), ValueError, "elements"),
        (dict(rows=3), ValueError, "kv"),
        (dict(layout=FP8_FLOAT32_SF_INDEX_KV_FORMAT), ValueError, "bytes per token"),
        (dict(kv_device="meta"), ValueError, "kv"),
    ],
)
def test_bad_input_raises_and_leaves_the_cache_unchanged(kwargs, exc, match):
    cache = _random_cache(V41_FORMAT, 2, 4)
    before = _storage(cache).clone()
    slots = torch.tensor(kwargs.get("slots", [0, 5]), dtype=kwargs.get("slot_dtype", torch.int32))
    kv = torch.randn(kwargs.get("rows", 2), kwargs.get("elements", 512))
    kv = kv.to(kwargs.get("kv_dtype", torch.bfloat16)).to(kwargs.get("kv_device", "cpu"))
    for fn in (store_kv_cache, store_kv_cache_triton):
        with pytest.raises(exc, match=match):
            fn(kv, cache, slots, layout=kwargs.get("layout"))
    assert torch.equal(_storage(cache), before)


# GPU cases: every format at block size 64, the named ones at 133 too, and the integer
# (non-hardware) fp8 rounding path for the fp8 formats.
GPU_CASES = (
    [(f, 64, True) for f in ALL_FORMATS]
    + [(f, 133, True) for f in SUPPORTED_KV_CACHE_FORMATS]
    + [
        (f, 64, False)
        for f in (V41_FORMAT, FP8_FLOAT32_SF_INDEX_KV_FORMAT, ENGINE_FP8, SEARCH_ODD, ENGINE_FP4)
    ]
    + [(ENGINE_INT8, 133, True), (ENGINE_INT8, 64, False)]
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout, block_size, hw", GPU_CASES, ids=[f"{f.note}-{b}-{h}" for f, b, h in GPU_CASES]
)
def test_gpu_triton_is_bit_exact_with_torch_and_reference(layout, block_size, hw):
    num_blocks, n = 40, 2000
    kv = _random_kv(n, layout, seed=7).cuda()
    slots = _random_slots(n, num_blocks * block_size, seed=7, num_skip=100).cuda()
    a = _random_cache(layout, num_blocks, block_size, device="cuda")
    b = _random_cache(layout, num_blocks, block_size, device="cuda")
    store_kv_cache_triton(kv, a, slots, layout=layout, config={"hw": hw})
    store_kv_cache_torch(kv, b, slots, layout=layout)
    assert torch.equal(_storage(a), _storage(b))
    ref = _random_cache(layout, num_blocks, block_size)
    s = torch.tensor([0, 5, -1, 11, num_blocks * block_size - 1], dtype=torch.int32)
    store_kv_cache_ref(kv[:5].cpu(), ref, s, layout=layout)
    gpu = _random_cache(layout, num_blocks, block_size, device="cuda")
    store_kv_cache_triton(kv[:5], gpu, s.cuda(), layout=layout, config={"hw": hw})
    assert torch.equal(_storage(gpu).cpu(), _storage(ref))


@pytest.mark.gpu
def test_gpu_store_inside_cuda_graph_replays_new_inputs():
    layout = V41_FORMAT
    cache = _random_cache(layout, 8, 64, device="cuda")
    kv = _random_kv(256, layout).cuda()
    slots = _random_slots(256, 512).cuda()
    store_kv_cache(kv, cache, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv_cache(kv, cache, slots)
    kv.copy_(_random_kv(256, layout, seed=9))
    slots.copy_(_random_slots(256, 512, seed=9))
    expected = _random_cache(layout, 8, 64, device="cuda")
    _storage(expected).copy_(_storage(cache))
    store_kv_cache_torch(kv, expected, slots)
    graph.replay()
    assert torch.equal(_storage(cache), _storage(expected))


@pytest.mark.parametrize("config", [{"rows": 1}, {"rows": 2, "num_warps": 1}])
def test_small_program_tiles_write_the_same_bytes(config):
    layout = V41_FORMAT
    kv = _random_kv(5, layout)
    slots = _random_slots(5, 12, num_skip=1)
    a, b = _random_cache(layout, 3, 4), _random_cache(layout, 3, 4)
    store_kv_cache_triton(kv, a, slots, layout=layout, config=config)
    store_kv_cache_ref(kv, b, slots, layout=layout)
    assert torch.equal(_storage(a), _storage(b))


def _finite_bf16_bit_patterns(n, elements, seed):
    """Random bf16 bit patterns (subnormals, +-0, huge values), infinities and NaNs removed."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-32768, 32768, (n, elements), generator=g, dtype=torch.int16)
    x = bits.view(torch.bfloat16)
    x[~torch.isfinite(x.float())] = 0.0
    x[0] = -0.0  # an all negative-zero row
    x[1, ::2] = -0.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout", [FP8_FLOAT32_SF_INDEX_KV_FORMAT, ODD_FORMATS[1], ENGINE_INT8], ids=_ids
)
def test_gpu_fast_division_equals_div_rn(layout):
    """fp32-scale stores: the per-group reciprocal path (``fast_div``) writes the same bytes as
    IEEE ``div.rn`` on random bit patterns (subnormals, signed zeros, huge magnitudes)."""
    n, block_size = 4096, 64
    num_blocks = n // block_size
    slots = torch.arange(n, dtype=torch.int32, device="cuda")
    for seed in range(4):
        kv = _finite_bf16_bit_patterns(n, layout.elements, seed).cuda()
        a = _random_cache(layout, num_blocks, block_size, device="cuda")
        b = _random_cache(layout, num_blocks, block_size, device="cuda")
        store_kv_cache_triton(kv, a, slots, layout=layout, config={"fast_div": True})
        store_kv_cache_triton(kv, b, slots, layout=layout, config={"fast_div": False})
        assert torch.equal(_storage(a), _storage(b))
        store_kv_cache_torch(kv, b, slots, layout=layout)
        assert torch.equal(_storage(a), _storage(b))


_SM90_DIV_COUNT = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvplan.ops._store_kernels import store_quant_kernel as fn
cx = dict(BLOCK_SIZE=64, E=128, GS=128, G=1, GS_P2=128, G_P2=1, GB=128, GB_P2=128, QB=128,
          FP4=False, SF=2, SB=4, FLAT=True, HW=True, ROWS=8, VALIGN=16, SALIGN=4,
          SEARCH=len(sys.argv) > 3,
          FAST_DIV=sys.argv[1] == "1", INT8=sys.argv[2] == "1",
          QMAX=127.0 if sys.argv[2] == "1" else 448.0)
types = {"x_ptr": "*bf16", "slot_ptr": "*i32", "cache_ptr": "*u8"}
sig = {a: "constexpr" if a in cx else types.get(a, "i32") for a in fn.arg_names}
ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx),
                     target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(ptx.count("div.rn.f32"), ptx.count("rcp.approx"))
"""


def _sm90_div_counts(*args: str) -> tuple[int, int]:
    """(div.rn.f32, rcp.approx) in the PTX of `_SM90_DIV_COUNT` run with ``args`` (fast_div,
    int8[, search]) in a subprocess (this process runs the interpreter); skips without ptxas."""
    import os
    import subprocess
    import sys

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - no CUDA toolchain in this Triton install
        pytest.skip(f"no ptxas: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SM90_DIV_COUNT, *args], env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return tuple(int(v) for v in out.split())


@pytest.mark.parametrize("int8", ["0", "1"], ids=["e4m3", "int8"])
def test_fast_division_compiles_for_sm90_without_per_element_div(int8):
    """CPU counterpart: the fp32-scale store (e4m3 or int8 values) compiled for sm_90 divides
    only to make the scales, not per element."""
    counts = {fast: _sm90_div_counts(fast, int8) for fast in ("0", "1")}
    # ROWS x GS = 1024 elements over 128 threads: each thread divides its 8 elements and
    # (replicated) the scales of its rows; fast_div removes the 8 element divisions
    assert counts["0"][1] == 0 and counts["1"][1] >= 1, counts
    assert counts["0"][0] - counts["1"][0] >= 8, counts


def test_searched_scales_compile_for_sm90_dividing_only_for_the_candidates():
    """The searched-scale store compiled for sm_90 (fast division): the first candidate and the
    (not unrolled) loop over the other eight each divide twice per group (``a / c`` and
    ``c / a``) where the plain store divides once, and no element is divided by div.rn."""
    plain, searched = _sm90_div_counts("1", "0"), _sm90_div_counts("1", "0", "search")
    assert searched[0] == 4 * plain[0], (plain, searched)


@pytest.mark.parametrize("force_triton", ["1", ""], ids=["triton", "torch"])
def test_cached_plans_match_uncached_across_caches(monkeypatch, force_triton):
    """The plan cache of store_kv_cache (validated metadata + launch parameters reused across
    calls) writes the same bytes as a fresh plan per call, with calls alternating between
    caches whose format, block size, block stride (a strided slice) or kv shape differ, so a
    stale or shared entry would show up."""
    from kvplan.ops import store as store_mod

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", force_triton)
    wide = _random_cache(V41_FORMAT, 6, 4, seed=9)
    cases = [
        (V41_FORMAT, _random_cache(V41_FORMAT, 3, 4, seed=1), (1,)),
        (V41_FORMAT, wide[::2], (1,)),  # same shape as above, larger block stride
        (FP8_FLOAT32_SF_INDEX_KV_FORMAT, _random_cache(FP8_FLOAT32_SF_INDEX_KV_FORMAT, 3, 4), ()),
        (SUPPORTED_KV_CACHE_FORMATS[4], _random_cache(SUPPORTED_KV_CACHE_FORMATS[4], 3, 4), ()),
        (SUPPORTED_KV_CACHE_FORMATS[2], _random_cache(SUPPORTED_KV_CACHE_FORMATS[2], 2, 8), (2,)),
        (SUPPORTED_KV_CACHE_FORMATS[1], _random_cache(SUPPORTED_KV_CACHE_FORMATS[1], 2, 4), (4,)),
        (bf16_format(24), _random_cache(bf16_format(24), 3, 4), (2,)),
    ]
    results = {}
    for cached in (True, False):
        g = torch.Generator().manual_seed(5)
        store_mod._PLANS.clear()
        caches = [c.clone() if c.is_contiguous() else c for _, c, _ in cases]
        if not caches[1].is_contiguous():
            caches[1] = wide.clone()[::2]
        for step in range(2):
            for (layout, _, mid), cache in zip(cases, caches, strict=True):
                n = 3 + step
                e = layout.elements // (mid[0] if mid else 1)
                kv = torch.randn((n, *mid, e), generator=g, dtype=torch.float32).bfloat16()
                slots = torch.randperm(cache.shape[0] * cache.shape[1], generator=g)[:n]
                slots[0] = -1
                if not cached:
                    store_mod._PLANS.clear()
                store_kv_cache(kv, cache, slots.int(), layout=layout, check=step == 0)
        if cached:
            assert len(store_mod._PLANS) == len(cases)
        results[cached] = [_storage(c).clone() for c in caches]
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


def test_errors_unchanged_once_a_plan_exists():
    """After a successful call has cached its plan, bad calls on the same cache still raise
    the full path's errors (row count, slot range with check=True, layout type)."""
    cache = alloc_kv_cache(2, 4, V41_FORMAT)
    kv = torch.zeros(2, 512, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    store_kv_cache(kv, cache, slots, check=False)
    store_kv_cache(kv, cache, slots, check=False)  # plan hit
    with pytest.raises(ValueError, match=r"kv must have shape \[n=2"):
        store_kv_cache(kv[:1], cache, slots, check=False)
    with pytest.raises(ValueError, match="slot_mapping holds 8, outside"):
        store_kv_cache(kv, cache, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(TypeError, match="layout must be a KVCacheFormat or None, got list"):
        store_kv_cache(kv, cache, slots, layout=[V41_FORMAT])


# ---- non-finite input and unchecked slots: one meaning on every path ----

NONFINITE_FORMATS = [
    *SUPPORTED_KV_CACHE_FORMATS,
    ENGINE_FP8,
    bf16_format(24),
    ODD_FORMATS[0],  # e4m3, partial last group (non-flat kernel path)
    SEARCH_ODD,
    ENGINE_FP4,
    SEARCH_FP4_ODD,
    ODD_FORMATS[1],  # e2m1 with fp32 scales, groups of 10 (non-flat FP4 path)
    ENGINE_INT8,
    INT8_ODD,
]
# bf16 bit patterns: +inf, -inf, quiet NaN, negative NaN, NaN with a payload
_PINF, _NINF, _NAN, _NEG_NAN, _NAN_PAYLOAD = 0x7F80, -128, 0x7FC0, -64, 0x7F81


def _nonfinite_kv(layout, seed=0):
    """Six rows: non-finite values at even and odd positions (both FP4 nibbles), mixed with
    huge and tiny finite ones, a group that is all NaN, a group that is all +-inf, a row
    without non-finite values (row 3) and a skipped row (row 5, NaN everywhere)."""
    kv = _random_kv(6, layout, seed=seed)
    bits = kv.view(torch.int16)
    gs = layout.elements_per_sf or 8
    e = layout.elements
    bits[0, 0], bits[0, 3], bits[0, e - 1] = _PINF, _NAN, _NINF
    kv[0, 1] = 3.0e38  # the finite amax of group 0 is huge
    bits[1, : gs if e > gs else e // 2] = _NAN
    bits[1, e - 2] = _NEG_NAN
    bits[2, :gs:2], bits[2, 1:gs:2] = _PINF, _NINF
    bits[2, e // 2] = _NAN_PAYLOAD
    kv[2, e // 2 + 1] = 1e-30  # the rest of that group is tiny
    bits[4, 1::3] = _NINF
    bits[5] = _NAN
    return kv


def _record(cache, layout, slot):
    """(value bytes, scale bytes) of one slot, as uint8 rows."""
    values, scales = split_kv_cache(cache, layout)
    block, offset = divmod(slot, cache.shape[1])
    v = values[block, offset].contiguous().view(torch.uint8).flatten()
    if scales is None:
        return v, None
    return v, scales[block, offset].contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("layout", NONFINITE_FORMATS, ids=_ids)
def test_non_finite_input_is_refused_with_check_and_writes_nothing(layout):
    kv = _nonfinite_kv(layout)
    slots = torch.tensor([3, 0, 5, 1, 7, -1], dtype=torch.int32)
    cache = _random_cache(layout, 2, 4)
    before = _storage(cache).clone()
    entries = (store_kv_cache, store_kv_cache_torch, store_kv_cache_triton, store_kv_cache)
    for fn in entries:  # the second store_kv_cache call takes the cached-plan path
        with pytest.raises(ValueError, match=r"kv row 0 \(slot 3\) holds a non-finite value"):
            fn(kv, cache, slots, layout=layout)
        assert torch.equal(_storage(cache), before)
    # only written rows count: NaN in a skipped row (slot -1) is accepted
    store_kv_cache(kv[[3, 5]], cache, slots[[3, 5]], layout=layout)
    with pytest.raises(ValueError, match="kv row 1 .* at element 1[);]"):
        store_kv_cache(kv[3:5], cache, slots[3:5], layout=layout)


@pytest.mark.parametrize("layout", NONFINITE_FORMATS, ids=_ids)
def test_non_finite_input_unchecked_saturates_with_equal_bytes_on_every_path(layout):
    """check=False: reference, torch path and Triton interpreter write the same bytes, and
    they follow the documented rule, checked here through the record bytes: the scales (and
    every finite value) are those of the input with its non-finite values zeroed, +-inf loads
    as +-QMAX * scale and NaN as +0. BF16 caches keep the bits."""
    from kvplan import quant

    kv = _nonfinite_kv(layout)
    slots = torch.tensor([3, 0, 5, 1, 7, -1], dtype=torch.int32)
    results = []
    for fn in (store_kv_cache_ref, store_kv_cache_torch, store_kv_cache_triton):
        cache = _random_cache(layout, 2, 4)
        kwargs = {} if fn is store_kv_cache_ref else {"check": False}
        fn(kv, cache, slots, layout=layout, **kwargs)
        results.append(cache)
    for other in results[1:]:
        assert torch.equal(_storage(other), _storage(results[0]))
    cache = results[0]
    finite = torch.isfinite(kv.float())
    zeroed = torch.where(finite, kv, torch.zeros_like(kv))
    ref = _random_cache(layout, 2, 4)
    store_kv_cache_ref(zeroed, ref, slots, layout=layout)
    for i, slot in enumerate(slots.tolist()[:5]):
        v, s = _record(cache, layout, slot)
        if not layout.is_quantized:
            assert torch.equal(v, kv[i].view(torch.uint8))
            continue
        v0, s0 = _record(ref, layout, slot)
        assert torch.equal(s, s0), f"row {i}: the scales come from the finite values"
        got = quant.dequantize(v[None], s[None], layout)[0].float()
        want = quant.dequantize(v0[None], s0[None], layout)[0].float()
        assert torch.equal(got[finite[i]], want[finite[i]]), f"row {i}"
        x = kv[i].float()
        qmax = quant.QMAX[layout.quantized_dtype]
        group = torch.arange(layout.elements) // layout.elements_per_sf
        sat = (torch.sign(x) * qmax * quant.scale_factors(s[None], layout)[0][group]).bfloat16()
        inf = torch.isinf(x)
        assert torch.equal(got[inf], sat[inf].float()), f"row {i}"
        nan = torch.isnan(x)
        assert (got[nan] == 0).all() and not torch.signbit(got[nan]).any(), f"row {i}"
    assert (finite[3]).all() and torch.equal(
        _record(cache, layout, 1)[0], _record(ref, layout, 1)[0]
    )


@pytest.mark.parametrize("layout", NONFINITE_FORMATS, ids=_ids)
def test_unchecked_out_of_range_slots_are_skipped_on_every_path(layout):
    """check=False with slots outside [0, num_slots) (just past the end, inside the last
    block's padding, far away, below -1): every path writes the in-range rows only, exactly as
    if the others were -1, and never a partial record."""
    num_blocks, block_size = 2, 3
    num_slots = num_blocks * block_size
    kv = _random_kv(6, layout, seed=3)
    slots = torch.tensor([4, num_slots, num_slots + 1, 2**31 - 1, -7, 0], dtype=torch.int32)
    expected = _random_cache(layout, num_blocks, block_size)
    skipped = torch.where((slots >= 0) & (slots < num_slots), slots, -1)
    store_kv_cache_ref(kv, expected, skipped, layout=layout)
    entries = (
        store_kv_cache_ref,
        store_kv_cache_torch,
        store_kv_cache_triton,
        store_kv_cache,
        store_kv_cache,  # cached plan
    )
    for fn in entries:
        cache = _random_cache(layout, num_blocks, block_size)
        kwargs = {} if fn is store_kv_cache_ref else {"check": False}
        fn(kv, cache, slots, layout=layout, **kwargs)
        assert torch.equal(_storage(cache), _storage(expected)), fn.__name__


@pytest.mark.gpu
@pytest.mark.parametrize("hw", [True, False])
@pytest.mark.parametrize("layout", NONFINITE_FORMATS, ids=_ids)
def test_gpu_non_finite_input_and_bad_slots_match_the_cpu_bytes(layout, hw):
    """The GPU kernel (hardware or integer fp8 rounding, fp32 scales through ``fast_div`` when
    ``hw``) writes the CPU torch path's bytes for non-finite input and out-of-range slots."""
    num_blocks, block_size = 8, 64
    kv = torch.cat([_nonfinite_kv(layout, seed=s) for s in range(50)])  # [300, elements]
    slots = _random_slots(kv.shape[0], num_blocks * block_size, seed=1, num_skip=20)
    slots[::7] = torch.tensor([num_blocks * block_size, 2**31 - 1, -5]).repeat(43)[:43]
    cpu = _random_cache(layout, num_blocks, block_size)
    store_kv_cache_torch(kv, cpu, slots, layout=layout, check=False)
    gpu = _random_cache(layout, num_blocks, block_size, device="cuda")
    store_kv_cache_triton(kv.cuda(), gpu, slots.cuda(), layout=layout, check=False,
                          config={"hw": hw})  # fmt: skip
    assert torch.equal(_storage(gpu).cpu(), _storage(cpu))
    gpu = _random_cache(layout, num_blocks, block_size, device="cuda")
    store_kv_cache(kv.cuda(), gpu, slots.cuda(), layout=layout, check=False)
    assert torch.equal(_storage(gpu).cpu(), _storage(cpu))
    with pytest.raises(ValueError, match="non-finite"):
        store_kv_cache(kv.cuda(), gpu, slots.cuda().clamp(-1, 0), layout=layout)


# ---- int8: the rounding rule and the error bound ----


@pytest.mark.parametrize("layout", [ENGINE_INT8, INT8_ODD], ids=_ids)
def test_int8_rounds_half_to_even_and_saturates(layout):
    """A group whose amax is 127 has scale 1: x / scale is x, so half-integers show the tie
    rule (to even) and the bytes are two's complement; every path writes them."""
    row = torch.zeros(layout.elements)
    ties = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, -1.5, -127.0, -0.0, 0.25, 126.5]
    row[: len(ties)] = torch.tensor(ties)
    kv = row[None].bfloat16()
    want = [127, 2, 4, -2, -4, 0, 0, 2, -2, -127, 0, 0, 126]
    for fn in (store_kv_cache_ref, store_kv_cache_torch, store_kv_cache_triton):
        cache = _random_cache(layout, 1, 4)
        fn(kv, cache, torch.tensor([2], dtype=torch.int32), layout=layout)
        v, s = _record(cache, layout, 2)
        assert v.view(torch.int8)[: len(want)].tolist() == want, fn.__name__
        assert s.view(torch.float32)[0].item() == 1.0, fn.__name__


@pytest.mark.parametrize("layout", [ENGINE_INT8, INT8_ODD], ids=_ids)
def test_int8_round_trip_error_is_at_most_half_a_scale(layout):
    """|x - value * scale| <= scale / 2 (exact fp64 check; the fp32 quotient x / scale, up to
    127, may be off by half an ulp, 2^-17, hence that slack), codes in [-127, 127], and each
    group's largest magnitude maps to +-127."""
    from kvplan import quant

    n = 64
    kv = _random_kv(n, layout, seed=5)
    cache = _random_cache(layout, 4, 16)
    slots = torch.arange(n, dtype=torch.int32)
    store_kv_cache_triton(kv, cache, slots, layout=layout)
    values, scales = split_kv_cache(cache, layout)
    codes = values.reshape(n, -1).float()  # int8 view
    sf = scales.reshape(n, -1).float()
    group = torch.arange(layout.elements) // layout.elements_per_sf
    x = kv.double()
    err = (x - codes.double() * sf[:, group].double()).abs()
    assert (err <= sf[:, group].double() * (0.5 + 2**-17)).all()
    assert (err > sf[:, group].double() * 0.49).any()  # the bound is not vacuous
    assert codes.abs().max() <= 127 and (codes != -128).all()
    nonzero = x.abs().amax(dim=1) > 0
    grouped_codes = torch.zeros(n, layout.num_scales).index_reduce_(
        1, group, codes.abs(), "amax", include_self=False
    )
    assert (grouped_codes[nonzero] == 127).all()
    deq = quant.dequantize(values.reshape(n, -1).view(torch.uint8), scales.reshape(n, -1)
                           .contiguous().view(torch.uint8), layout)  # fmt: skip
    assert torch.equal(deq, (codes * sf[:, group]).bfloat16())


def test_int8_format_rules_and_unsupported_paths():
    """int8 takes fp32 scales only; the index-cache loader refuses it instead of misreading."""
    from kvplan.ops.load import load_paged_kv_cache

    with pytest.raises(ValueError, match="sf_format must be 'fp32' for int8"):
        KVCacheFormat("int8", 64, 32, 0, True, "ue8m0", "bad", True)
    cache = alloc_kv_cache(2, 4, ENGINE_INT8)
    segs = torch.tensor([[0, 0, 0, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="quantized_dtype 'int8' is not supported"):
        load_paged_kv_cache(cache, segs, 4, layout=ENGINE_INT8)
