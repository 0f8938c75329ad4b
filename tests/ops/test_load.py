"""load_paged_kv_cache: Triton (interpreter on CPU, bit-exact on GPU), torch path and
per-element reference agree for every format; store -> load round trips within the
quantization bound (exactly for BF16); out= semantics and input validation."""

import pytest
import torch
from ops_testlib import ENGINE_FP8, ODD_FORMATS, all_formats
from ops_testlib import ids as _ids

from kvplan.formats import (
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
    SUPPORTED_KV_CACHE_FORMATS,
    V41_FORMAT,
    V41_FP4_FORMAT,
    alloc_kv_cache,
    bf16_format,
)
from kvplan.load_plan import BlockLoadPlanBuilder
from kvplan.ops.load import (
    LoadedIndexKV,
    load_paged_kv_cache,
    load_paged_kv_cache_ref,
    load_paged_kv_cache_torch,
    load_paged_kv_cache_triton,
)
from kvplan.ops.store import store_kv_cache_torch

ALL_FORMATS = all_formats(ODD_FORMATS)


def _random_kv(n, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, layout.elements, generator=g)
    x = x * torch.exp2(torch.empty(n, 1).uniform_(-8, 8, generator=g))
    x[::5] = 0
    return x.bfloat16()


def _filled_cache(layout, num_blocks, block_size, seed=0, device="cpu"):
    """A cache with every slot holding stored random K/V; returns (cache, kv by slot)."""
    cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
    n = num_blocks * block_size
    kv = _random_kv(n, layout, seed).to(device)
    store_kv_cache_torch(
        kv, cache, torch.arange(n, dtype=torch.int32, device=device), layout=layout
    )
    return cache, kv


def _plan(block_size, num_blocks, seed=0):
    """A plan mixing paged ranges, zero fills and ring ranges (what the planners emit)."""
    g = torch.Generator().manual_seed(seed)
    builder = BlockLoadPlanBuilder(block_size)
    table = torch.randperm(num_blocks, generator=g).tolist()
    builder.append_zero_fill(block_size + 1)
    builder.append_paged_range(table, 1, min(len(table) * block_size, 3 * block_size - 1))
    builder.append_ring_range(table[0], block_size - 2, 2 * block_size - 3)
    builder.append_segment(table[-1], 0, block_size)
    return builder.build()


def _fresh_out(layout, total_k, fill=0):
    from kvplan.ops.load import _alloc_out

    out = _alloc_out(layout, total_k, torch.device("cpu"))
    for t in out if isinstance(out, tuple) else (out,):
        t.view(torch.uint8).fill_(fill)
    return out


def _bytes(out):
    if isinstance(out, tuple):
        return tuple(t.view(torch.uint8).reshape(t.shape[0], -1) for t in out)
    return (out.view(torch.uint8),)


@pytest.mark.parametrize("block_size", [4, 7, 133])
@pytest.mark.parametrize("layout", ALL_FORMATS, ids=_ids)
def test_triton_torch_and_reference_agree(layout, block_size):
    cache, _ = _filled_cache(layout, 3, block_size, seed=block_size)
    segments, total_k = _plan(block_size, 3, seed=block_size)
    ref = load_paged_kv_cache_ref(cache, segments, total_k, layout=layout)
    for fn in (load_paged_kv_cache_torch, load_paged_kv_cache_triton):
        got = fn(cache, segments, total_k, _fresh_out(layout, total_k), layout=layout)
        if isinstance(ref, tuple):
            assert isinstance(got, LoadedIndexKV)
            values, scales = _bytes(got)
            assert torch.equal(values, ref[0])
            assert torch.equal(scales[:, : layout.sf_bytes], ref[1])
            assert not scales[:, layout.sf_bytes :].any()  # UE8M0 int32 padding
        else:
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def _bound(layout, x):
    """Per-element error bound of one store -> load round trip (x: fp32 [n, elements])."""
    per = layout.elements_per_sf
    groups = torch.nn.functional.pad(x.abs(), (0, (-x.shape[1]) % per)).view(x.shape[0], -1, per)
    amax = groups.amax(-1).repeat_interleave(per, dim=1)[:, : x.shape[1]]
    if layout.quantized_dtype == "e2m1":
        return x.abs() / 4 + amax / 8
    return x.abs() / 16 + amax / 64


# e4m3 values with e4m3 scales are excluded: amax / 448 falls in the e4m3 subnormal range for
# ordinary data, so the scale itself carries up to 33% error (a valid but poor format).
ROUND_TRIP_FORMATS = [f for f in ALL_FORMATS if f.note != "fp8 with e4m3 scales"]


@pytest.mark.parametrize("layout", ROUND_TRIP_FORMATS, ids=_ids)
def test_store_load_round_trip_within_quantization_bound(layout):
    block_size = 5
    cache, kv = _filled_cache(layout, 4, block_size, seed=1)
    builder = BlockLoadPlanBuilder(block_size)
    builder.append_paged_range([2, 0, 3, 1], 0, 4 * block_size)
    segments, total_k = builder.build()
    slots = torch.tensor([2, 0, 3, 1]).repeat_interleave(block_size) * block_size
    slots = slots + torch.arange(block_size).repeat(4)
    x = kv[slots].float()
    got = load_paged_kv_cache(cache, segments, total_k, layout=layout)
    if not layout.is_quantized:
        assert torch.equal(got, kv[slots])
        return
    if not layout.do_cast:  # dequantize the raw output with the torch path
        from kvplan import quant

        values, scales = _bytes(got)
        got = quant.dequantize(values, scales[:, : layout.sf_bytes], layout)
    err = (got.float() - x).abs()
    assert torch.isfinite(got.float()).all()
    assert (err <= _bound(layout, x)).all()
    assert (got[x == 0] == 0).all()


def test_index_output_dtypes_and_shapes():
    for layout, vshape, sdtype, sshape in [
        (FP4_INDEX_KV_FORMAT, (6, 64), torch.int32, (6,)),
        (MXFP8_INDEX_KV_FORMAT, (6, 128), torch.int32, (6,)),
        (FP8_FLOAT32_SF_INDEX_KV_FORMAT, (6, 128), torch.float32, (6,)),
        (ODD_FORMATS[3], (6, 20), torch.int32, (6, 2)),
    ]:
        cache, _ = _filled_cache(layout, 2, 4)
        seg = torch.tensor([[1, 0, 4, 0], [-1, 0, 2, 4]], dtype=torch.int32)
        out = load_paged_kv_cache(cache, seg, 6, layout=layout)
        assert out.values.shape == vshape and out.scales.shape == sshape
        assert out.scales.dtype == sdtype
        assert not _bytes(out)[0][4:].any() and not _bytes(out)[1][4:].any()
    whole_block = torch.tensor([[0, 0, 4, 0]], dtype=torch.int32)
    fp4 = load_paged_kv_cache(_filled_cache(FP4_INDEX_KV_FORMAT, 1, 4)[0], whole_block, 4)
    assert fp4.values.dtype == torch.float4_e2m1fn_x2
    v41 = load_paged_kv_cache(_filled_cache(V41_FORMAT, 1, 4)[0], whole_block, 4)
    assert v41.dtype == torch.bfloat16 and v41.shape == (4, 512)


@pytest.mark.parametrize(
    "config",
    [{"tile_t": 1}, {"tile_t": 2, "num_warps": 1}, {"segs": 2}, {"tile_t": 2, "segs": 4}],
)
@pytest.mark.parametrize(
    "layout",
    [V41_FP4_FORMAT, MXFP8_INDEX_KV_FORMAT, FP8_FLOAT32_SF_INDEX_KV_FORMAT, FP4_INDEX_KV_FORMAT],
    ids=_ids,
)
def test_small_program_tiles_load_the_same_rows(layout, config):
    """Tiles smaller than a block, and programs spanning several segments (``segs``: the
    last program only partly covered by segments), write exactly the torch path's rows."""
    cache, _ = _filled_cache(layout, 3, 4)
    segments, total_k = _plan(4, 3)
    got = load_paged_kv_cache_triton(cache, segments, total_k, _fresh_out(layout, total_k),
                                     layout=layout, config=config)  # fmt: skip
    want = load_paged_kv_cache_torch(cache, segments, total_k, _fresh_out(layout, total_k),
                                     layout=layout)  # fmt: skip
    for x, y in zip(_bytes(got), _bytes(want), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "layout", [FP8_FLOAT32_SF_INDEX_KV_FORMAT, MXFP8_INDEX_KV_FORMAT], ids=_ids
)
def test_gpu_sized_multi_segment_programs_load_the_same_rows(layout):
    """The GPU's choice for index caches at block size 32: two whole-block segments per
    program (64 rows x 128 value bytes next to 64 x 4 scale bytes). This shape once failed
    Triton 3.6's layout pass on the GPU (a select on the row mask); it must also compile
    (`tools/compile_sm90.py`)."""
    cache, _ = _filled_cache(layout, 3, 32)
    segments, total_k = _plan(32, 3)
    config = {"segs": 2, "tile_t": 32, "num_warps": 4}
    got = load_paged_kv_cache_triton(cache, segments, total_k, _fresh_out(layout, total_k),
                                     layout=layout, config=config)  # fmt: skip
    want = load_paged_kv_cache_torch(cache, segments, total_k, _fresh_out(layout, total_k),
                                     layout=layout)  # fmt: skip
    for x, y in zip(_bytes(got), _bytes(want), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fn", [load_paged_kv_cache, load_paged_kv_cache_triton])
def test_out_is_written_in_place_and_rows_outside_the_plan_are_kept(fn):
    cache, kv = _filled_cache(V41_FP4_FORMAT, 2, 4)
    buffer = torch.full((12, 1, 512), 7.0, dtype=torch.bfloat16)  # [N, 1, D] like the prefill kv
    seg = torch.tensor([[1, 1, 3, 0], [-1, 0, 2, 5]], dtype=torch.int32)  # rows 2..4 not in plan
    out = fn(cache, seg, 7, buffer[3:10], layout=V41_FP4_FORMAT)
    assert out.data_ptr() == buffer[3].data_ptr()
    ref = load_paged_kv_cache_ref(cache, seg, 7, layout=V41_FP4_FORMAT)
    assert torch.equal(buffer[3:5, 0], ref[0:2]) and torch.equal(buffer[8:10, 0], ref[5:7])
    assert (buffer[:3] == 7).all() and (buffer[5:8] == 7).all() and (buffer[10:] == 7).all()


def test_empty_plan_touches_nothing():
    cache, _ = _filled_cache(V41_FORMAT, 2, 4)
    out = torch.full((3, 512), 5.0, dtype=torch.bfloat16)
    empty = torch.empty(0, 4, dtype=torch.int32)
    for fn in (load_paged_kv_cache, load_paged_kv_cache_triton):
        assert fn(cache, empty, 3, out) is out
    assert (out == 5).all()


@pytest.mark.parametrize(
    "segments, total_k, match",
    [
        ([[2, 0, 4, 0]], 4, "src_block"),
        ([[-2, 0, 4, 0]], 4, "src_block"),
        ([[0, 2, 5, 0]], 4, "src_end"),
        ([[0, 3, 2, 0]], 4, "src_begin"),
        ([[0, 0, 4, 1]], 4, "total_k"),
        ([[0, 0, 2, 0], [1, 0, 2, 1]], 4, "overlap"),
        ([[0, 0, 2, 0]], -1, "total_k"),
    ],
)
def test_bad_plans_raise(segments, total_k, match):
    cache, _ = _filled_cache(V41_FORMAT, 2, 4)
    seg = torch.tensor(segments, dtype=torch.int32)
    for fn in (load_paged_kv_cache, load_paged_kv_cache_triton):
        with pytest.raises(ValueError, match=match):
            fn(cache, seg, total_k)


# bad segments (block_size 4, 3 blocks, total_k 10): source block out of range either way,
# negative begin, end past the block, destination partly below 0 or past total_k, extreme ints
_UNCHECKED_SEGMENTS = [
    [1, 0, 4, 0],  # valid: rows 0..3
    [-2, 0, 2, 4],  # src_block < -1: dropped
    [3, 0, 2, 4],  # src_block == num_blocks: dropped
    [2, -2, 2, 4],  # tokens 0..1 -> rows 6..7 (tokens -2, -1 do not exist)
    [0, 2, 9, 8],  # tokens 2..3 -> rows 8..9 (4.. past the block)
    [-1, 0, 3, -1],  # zero rows 0..1 (row -1 dropped); overwrites the first segment's rows
    [0, 0, 4, 9],  # token 0 -> row 9 (rows 10.. past total_k); overwrites the 5th segment's
    [2, -(2**31), 2**31 - 1, 0],  # every token of the block, rows 2^31.. all dropped
    [1, 2**31 - 1, 2**31 - 1, 3],  # empty
]


def _unchecked_expected_rows(segments, total_k, num_blocks, block_size):
    """The rows an unchecked load writes, segment by segment in plan order (a later segment
    wins here; the test plan has no row written twice by segments that differ)."""
    rows = {}
    for src, begin, end, dst in segments:
        if not -1 <= src < num_blocks:
            continue
        for t in range(max(begin, 0), min(end, block_size)):
            if 0 <= dst + t - begin < total_k:
                rows[dst + t - begin] = (src, t)
    return rows


@pytest.mark.parametrize(
    "layout",
    [V41_FORMAT, V41_FP4_FORMAT, FP4_INDEX_KV_FORMAT, MXFP8_INDEX_KV_FORMAT, bf16_format(24)],
    ids=_ids,
)
def test_unchecked_bad_plans_drop_the_same_rows_on_every_path(layout):
    """check=False with invalid segments: the torch path and the Triton interpreter copy the
    same rows (those whose source token and destination row exist) and nothing else; no
    exception, no write outside ``out``."""
    num_blocks, block_size, total_k = 3, 4, 10
    cache, _ = _filled_cache(layout, num_blocks, block_size)
    segments = [s for i, s in enumerate(_UNCHECKED_SEGMENTS) if i not in (5, 6)]
    seg = torch.tensor(segments, dtype=torch.int32)
    expected = _fresh_out(layout, total_k, fill=0x3C)
    rows = _unchecked_expected_rows(segments, total_k, num_blocks, block_size)
    one_token = [[src, t, t + 1, row] for row, (src, t) in rows.items()]
    load_paged_kv_cache_torch(cache, torch.tensor(one_token, dtype=torch.int32), total_k,
                              expected, layout=layout)  # fmt: skip
    assert sorted(rows) == [0, 1, 2, 3, 6, 7, 8, 9]
    fns = (load_paged_kv_cache_torch, load_paged_kv_cache_triton, load_paged_kv_cache)
    for fn in fns:
        out = _fresh_out(layout, total_k, fill=0x3C)
        fn(cache, seg, total_k, out, layout=layout, check=False)
        for x, y in zip(_bytes(out), _bytes(expected), strict=True):
            assert torch.equal(x, y), fn.__name__
    # rows named twice (a zero fill over the first segment's rows): one of the sources, whole
    seg = torch.tensor(_UNCHECKED_SEGMENTS, dtype=torch.int32)
    outs = [_fresh_out(layout, total_k, fill=0x3C) for _ in fns[:2]]
    for fn, out in zip(fns[:2], outs, strict=True):
        fn(cache, seg, total_k, out, layout=layout, check=False)
    for x, y in zip(_bytes(outs[0]), _bytes(outs[1]), strict=True):
        assert torch.equal(x[2:9], y[2:9])  # rows named once
    sources = {0: [(1, 0), (-1, 0)], 1: [(1, 1), (-1, 0)], 9: [(0, 3), (0, 0)]}
    for row, candidates in sources.items():
        wants = []
        for src, t in candidates:
            want = _fresh_out(layout, 1)
            one = torch.tensor([[src, t, t + 1, 0]], dtype=torch.int32)
            wants.append(_bytes(load_paged_kv_cache_torch(cache, one, 1, want, layout=layout)))
        for out in outs:
            got = [b[row] for b in _bytes(out)]
            assert any(all(torch.equal(g, w[0]) for g, w in zip(got, want)) for want in wants)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout", [V41_FORMAT, V41_FP4_FORMAT, FP4_INDEX_KV_FORMAT, bf16_format(24)], ids=_ids
)
def test_gpu_unchecked_bad_plans_match_the_cpu_rows(layout):
    num_blocks, block_size, total_k = 3, 4, 10
    cache, _ = _filled_cache(layout, num_blocks, block_size)
    segments = [s for i, s in enumerate(_UNCHECKED_SEGMENTS) if i not in (5, 6)]
    seg = torch.tensor(segments, dtype=torch.int32)
    want = load_paged_kv_cache_torch(cache, seg, total_k, _fresh_out(layout, total_k, 0x3C),
                                     layout=layout, check=False)  # fmt: skip
    out = _fresh_out(layout, total_k, 0x3C)
    out = tuple(t.cuda() for t in out) if isinstance(out, tuple) else out.cuda()
    for config in (None, {"segs": 2, "tile_t": 4}, {"tile_t": 2}):
        got = load_paged_kv_cache_triton(cache.cuda(), seg.cuda(), total_k, out, layout=layout,
                                         check=False, config=config)  # fmt: skip
        for x, y in zip(_bytes(got), _bytes(want), strict=True):
            assert torch.equal(x.cpu(), y), config


def test_bad_arguments_raise():
    cache, _ = _filled_cache(V41_FORMAT, 2, 4)
    seg = torch.tensor([[0, 0, 4, 0]], dtype=torch.int32)
    with pytest.raises(TypeError, match="load_segments"):
        load_paged_kv_cache(cache, seg.long(), 4)
    with pytest.raises(ValueError, match="load_segments"):
        load_paged_kv_cache(cache, seg[:, :3], 4)
    with pytest.raises(TypeError, match="out"):
        load_paged_kv_cache(cache, seg, 4, torch.empty(4, 512))
    with pytest.raises(ValueError, match="out"):
        load_paged_kv_cache(cache, seg, 4, torch.empty(5, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        load_paged_kv_cache(cache, seg, 4, torch.empty(4, 1024, dtype=torch.bfloat16)[:, ::2])
    index, _ = _filled_cache(MXFP8_INDEX_KV_FORMAT, 2, 4)
    with pytest.raises(TypeError, match="out"):
        load_paged_kv_cache(index, seg, 4, torch.empty(4, 128), layout=MXFP8_INDEX_KV_FORMAT)
    bad_scales = (
        torch.empty(4, 128, dtype=torch.float8_e4m3fn),
        torch.empty(4, dtype=torch.float32),
    )
    with pytest.raises(TypeError, match="out.scales"):
        load_paged_kv_cache(index, seg, 4, bad_scales, layout=MXFP8_INDEX_KV_FORMAT)


GPU_CASES = (
    [(f, 64, True) for f in ALL_FORMATS]
    + [(f, 133, True) for f in SUPPORTED_KV_CACHE_FORMATS]
    + [(f, 64, False) for f in (V41_FORMAT, V41_FP4_FORMAT, ENGINE_FP8)]
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout, block_size, hw", GPU_CASES, ids=[f"{f.note}-{b}-{h}" for f, b, h in GPU_CASES]
)
def test_gpu_triton_is_bit_exact_with_torch_and_reference(layout, block_size, hw):
    num_blocks = 24
    cache, _ = _filled_cache(layout, num_blocks, block_size, seed=3, device="cuda")
    segments, total_k = _plan(block_size, num_blocks, seed=3)
    builder = BlockLoadPlanBuilder(block_size)
    builder.append_paged_range(list(range(num_blocks))[::-1], 3, num_blocks * block_size - 5)
    more, more_k = builder.build()
    more[:, 3] += total_k
    segments = torch.cat([segments, more]).cuda()
    total_k += more_k
    cfg = {"hw": hw}
    a = load_paged_kv_cache_triton(cache, segments, total_k, layout=layout, config=cfg)
    b = load_paged_kv_cache_torch(cache, segments, total_k, layout=layout)
    for x, y in zip(_bytes(a), _bytes(b), strict=True):
        assert torch.equal(x, y)
    tiny = torch.tensor([[1, 2, 5, 0], [-1, 0, 2, 3], [num_blocks - 1, 0, 1, 5]], dtype=torch.int32)
    ref = load_paged_kv_cache_ref(cache.cpu(), tiny, 6, layout=layout)
    ref = ref if isinstance(ref, tuple) else (ref.view(torch.uint8),)
    got = _bytes(load_paged_kv_cache_triton(cache, tiny.cuda(), 6, layout=layout, config=cfg))
    assert torch.equal(got[0].cpu(), ref[0])
    if len(ref) == 2:
        assert torch.equal(got[1][:, : layout.sf_bytes].cpu(), ref[1])


@pytest.mark.gpu
def test_gpu_load_inside_cuda_graph_replays_new_plans():
    cache, _ = _filled_cache(V41_FORMAT, 8, 64, seed=4, device="cuda")
    segments = torch.tensor([[3, 0, 64, 0], [-1, 0, 10, 64]], dtype=torch.int32, device="cuda")
    out = torch.empty(74, 512, dtype=torch.bfloat16, device="cuda")
    load_paged_kv_cache(cache, segments, 74, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        load_paged_kv_cache(cache, segments, 74, out)
    segments.copy_(torch.tensor([[5, 0, 64, 10], [-1, 0, 10, 0]], dtype=torch.int32))
    graph.replay()
    want = load_paged_kv_cache_torch(cache, segments, 74, layout=V41_FORMAT)
    assert torch.equal(out, want)


def test_raw_segments_per_program_targets_32kb_and_keeps_256_programs(monkeypatch):
    from kvplan.ops import _load_launch as load
    from kvplan.ops.cache_geometry import cache_bytes

    monkeypatch.setattr(load, "triton_interpreting", lambda: False)
    _, geo = cache_bytes(alloc_kv_cache(1, 64, MXFP8_INDEX_KV_FORMAT), MXFP8_INDEX_KV_FORMAT)
    # 64 tokens x 132 bytes = 8.4 KB per segment: four segments per program (33.8 KB)
    assert load.raw_segments_per_program(4096, 64, 132, geo) == 4
    # 64K tokens = 1024 segments: 4 per program leave 256 programs; 1020 segments would not
    assert load.raw_segments_per_program(1024, 64, 132, geo) == 4
    assert load.raw_segments_per_program(1020, 64, 132, geo) == 2
    assert load.raw_segments_per_program(64, 64, 132, geo) == 1  # small batches stay spread
    assert load.raw_segments_per_program(4096, 16, 132, geo) == 1  # tile < block: 1 segment
    assert load.raw_segments_per_program(4096, 64, 68, geo) == 8  # FP4_INDEX: 34.8 KB


def _flat_out(out):
    if isinstance(out, LoadedIndexKV):
        return [out.values.view(torch.uint8).clone(), out.scales.contiguous().view(torch.uint8)]
    return [out.clone()]


@pytest.mark.parametrize("force_triton", ["1", ""], ids=["triton", "torch"])
def test_cached_plans_match_uncached_across_caches(monkeypatch, force_triton):
    """The plan cache of load_paged_kv_cache (validated metadata + launch parameters reused
    across calls) returns the same bytes as a fresh plan per call, with calls alternating
    between caches whose format, block size or block stride (strided slice) differ, with and
    without ``out`` (the second call with ``out`` reuses its validation), so a stale or shared
    entry would show up."""
    from kvplan.ops import load as load_mod

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", force_triton)
    wide, _ = _filled_cache(V41_FORMAT, 4, 4, seed=3)
    cases = [
        (V41_FORMAT, _filled_cache(V41_FORMAT, 2, 4, seed=1)[0]),
        (V41_FORMAT, wide[::2]),  # same shape as above, twice the block stride
        (FP8_FLOAT32_SF_INDEX_KV_FORMAT, _filled_cache(FP8_FLOAT32_SF_INDEX_KV_FORMAT, 2, 4)[0]),
        (MXFP8_INDEX_KV_FORMAT, _filled_cache(MXFP8_INDEX_KV_FORMAT, 2, 4)[0]),
        (FP4_INDEX_KV_FORMAT, _filled_cache(FP4_INDEX_KV_FORMAT, 2, 8)[0]),
        (V41_FP4_FORMAT, _filled_cache(V41_FP4_FORMAT, 2, 4)[0]),
        (bf16_format(24), _filled_cache(bf16_format(24), 2, 4)[0]),
    ]
    results = {}
    for cached in (True, False):
        load_mod._PLANS.clear()
        got = []
        for step in range(3):
            for layout, cache in cases:
                bs = cache.shape[1]
                segs = torch.tensor([[1, 1, bs, 0], [-1, 0, 2, bs - 1], [0, 0, 2 + step, bs + 1]])
                total_k = bs + 3 + step
                if not cached:
                    load_mod._PLANS.clear()
                out = None
                if step:
                    out = load_paged_kv_cache_torch(cache, segs.int(), total_k, layout=layout)
                    out = [t.zero_() for t in out] if isinstance(out, tuple) else out.zero_()
                    out = LoadedIndexKV(*out) if isinstance(out, list) else out
                res = load_paged_kv_cache(
                    cache, segs.int(), total_k, out, layout=layout, check=step == 0
                )
                got += _flat_out(res)
        if cached:
            assert len(load_mod._PLANS) == len(cases)
        results[cached] = got
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_errors_unchanged_once_a_plan_exists():
    """After successful calls have cached the plan and the ``out`` validation, bad calls still
    raise the full path's errors (total_k, output rows, plan range with check=True)."""
    L = MXFP8_INDEX_KV_FORMAT
    cache, _ = _filled_cache(L, 2, 4)
    segs = torch.tensor([[1, 0, 4, 0]], dtype=torch.int32)
    out = load_paged_kv_cache(cache, segs, 4, check=False, layout=L)
    load_paged_kv_cache(cache, segs, 4, out, check=False, layout=L)
    load_paged_kv_cache(cache, segs, 4, out, check=False, layout=L)  # plan and out validation hits
    with pytest.raises(ValueError, match="total_k must be a non-negative int"):
        load_paged_kv_cache(cache, segs, -1, check=False, layout=L)
    with pytest.raises(ValueError, match=r"out.values must hold \[total_k=5"):
        load_paged_kv_cache(cache, segs, 5, out, check=False, layout=L)
    with pytest.raises(ValueError):
        load_paged_kv_cache(cache, torch.tensor([[2, 0, 4, 0]], dtype=torch.int32), 4, layout=L)
