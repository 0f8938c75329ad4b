"""sparse_attention's split-column (flash-decoding) path and index_scores' tensor-core kernel:
the split kernels (CPU interpreter, tiny shapes, several split counts) equal the torch path,
including splits that see no column, rows that see nothing and heads without a sink; the
kernels compile for sm_90; on CUDA the split path and the bf16 index path equal the torch
references at DeepSeek-V4 shapes."""

from __future__ import annotations

import pytest
import torch
from sm90_compile import compile_sm90
from test_sparse_attention import FP4_64, FP8_64, _index_inputs, _inputs, _v4_inputs

from kvplan.formats import V41_FORMAT
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops import _sparse_split_kernels as _ks
from kvplan.ops._triton_util import merge_counters
from kvplan.ops.sparse_attention import (
    index_scores,
    index_scores_triton,
    sparse_attention,
    sparse_attention_torch,
    sparse_attention_triton,
    split_count,
)

# The CPU interpreter tests run the kernels on CPU tensors (TRITON_INTERPRET=1 without a GPU).
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")


def _hide_block(sources, lo: int, hi: int) -> None:
    """Columns ``[lo, hi)`` of the last source see nothing in every row."""
    sources[-1].index[:, lo:hi] = -1


@interpreter
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "kinds,head_dim", [(["fp32", "paged_bf16"], 32), ([FP8_64, FP4_64], 64)], ids=["plain", "q"]
)
def test_split_interpreter_equals_torch(kinds, head_dim, num_splits) -> None:
    """20 + 50 joined columns in tiles of 16: 2 / 3 / 5 splits of 48 / 32 / 16 columns;
    joined columns 32..47 (one whole split at 5) see nothing; row 0 sees nothing; head 1
    has no sink."""
    q, sources, sinks = _inputs(kinds, 4, 3, head_dim, [20, 50], seed=11)
    _hide_block(sources, 12, 28)
    sinks[1] = float("-inf")
    got = sparse_attention_triton(q, sources, sinks, head_dim**-0.5, tile_n=16,
                                  num_splits=num_splits)  # fmt: skip
    want = sparse_attention_torch(q, sources, sinks, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@interpreter
def test_split_one_source_bf16_queries() -> None:
    """One source, bf16 q and out, 3 splits, more heads than one head tile (tile_h 16)."""
    q, sources, sinks = _inputs([FP8_64], 3, 18, 64, [37], seed=12, dtype=torch.bfloat16)
    got = sparse_attention_triton(q, sources, sinks, 0.125, tile_n=16, num_splits=3)
    want = sparse_attention_torch(q, sources, sinks, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pv_split", [1, 2])
def test_out_rope_equals_norm_rope_after(num_splits, dtype, pv_split) -> None:
    """``out_rope``: the kernels' epilogue (one program, or the split combine) turns the
    output back exactly as ``norm_rope(out, cos, sin, inverse=True)`` after the attention
    does; the torch path likewise; pass-through channels untouched."""
    from kvplan.ops.rope import norm_rope_torch

    q, sources, sinks = _inputs(["paged_bf16", FP8_64], 3, 2, 64, [5, 19], seed=8, dtype=dtype)
    gen = torch.Generator().manual_seed(9)
    ang = torch.rand(3, 8, generator=gen) * 6.3
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)  # 16 rotary channels of 64
    kw = dict(tile_n=16, num_splits=num_splits, pv_split=pv_split)
    plain = sparse_attention_triton(q, sources, sinks, 0.125, **kw)
    got = sparse_attention_triton(q, sources, sinks, 0.125, out_rope=(cos, sin), **kw)
    want = norm_rope_torch(plain, cos, sin, inverse=True)
    assert torch.equal(got, want)
    assert torch.equal(got[..., :48], plain[..., :48])
    assert not torch.equal(got, plain)
    torch_path = sparse_attention_torch(q, sources, sinks, 0.125, out_rope=(cos, sin))
    want = norm_rope_torch(sparse_attention_torch(q, sources, sinks, 0.125), cos, sin,
                           inverse=True)  # fmt: skip
    assert torch.equal(torch_path, want)
    with pytest.raises(ValueError, match="out_rope cos"):
        sparse_attention_triton(q, sources, sinks, 0.125, out_rope=(cos[:2], sin[:2]))
    with pytest.raises(ValueError, match="out_rope sin"):
        sparse_attention_triton(q, sources, sinks, 0.125, out_rope=(cos, sin[:, :4]))
    with pytest.raises(TypeError, match="out_rope must be"):
        sparse_attention_triton(q, sources, sinks, 0.125, out_rope=cos)


@interpreter
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_fused_merge_equals_combine_kernel(monkeypatch, rope, num_splits) -> None:
    """The split kernel's last program merging (``FUSED_COMBINE``) gives the combine
    kernel's bits, with and without ``out_rope``, over two sources with hidden columns, more
    heads than one head tile; the counters are left zeroed for the next launch."""
    from kvplan.ops import sparse_attention as sa

    q, sources, sinks = _inputs(["paged_bf16", FP8_64], 3, 18, 64, [20, 50], seed=14,
                                dtype=torch.bfloat16)  # fmt: skip
    _hide_block(sources, 12, 28)
    sinks[1] = float("-inf")
    ang = torch.rand(3, 8, generator=torch.Generator().manual_seed(15)) * 6.3
    kw = dict(tile_n=16, num_splits=num_splits)
    if rope:
        kw["out_rope"] = (ang.cos().bfloat16(), ang.sin().bfloat16())
    monkeypatch.setattr(sa, "FUSED_COMBINE", False)
    want = sparse_attention_triton(q, sources, sinks, 0.125, **kw)
    monkeypatch.setattr(sa, "FUSED_COMBINE", True)
    for _ in range(2):  # a second launch starts from the counters the first one left
        got = sparse_attention_triton(q, sources, sinks, 0.125, **kw)
        assert torch.equal(got, want)
        assert not merge_counters(q.device).any()
    torch.testing.assert_close(got.float(), sparse_attention_torch(q, sources, sinks, 0.125,
                               out_rope=kw.get("out_rope")).float(), atol=2e-2, rtol=2e-2)  # fmt: skip


@interpreter
def test_caller_owned_merge_counters(monkeypatch) -> None:
    """``counters``: a caller's buffer gives the same bits as the shared one and is left
    zeroed; a buffer too small for the split call, of another dtype, rank or device, or not
    contiguous is refused naming it (nothing written)."""
    from kvplan.ops import sparse_attention as sa
    from kvplan.ops._triton_util import new_merge_counters

    monkeypatch.setattr(sa, "FUSED_COMBINE", True)
    q, sources, sinks = _inputs([FP8_64], 3, 18, 64, [37], seed=16, dtype=torch.bfloat16)
    kw = dict(tile_n=16, num_splits=3)
    want = sparse_attention_triton(q, sources, sinks, 0.125, **kw)
    mine = new_merge_counters(q.device, 6)  # 3 rows x 2 head groups
    for _ in range(2):
        assert torch.equal(sparse_attention_triton(q, sources, sinks, 0.125, counters=mine,
                                                   **kw), want)  # fmt: skip
        assert mine.dtype == torch.int32 and not mine.any()
    out = torch.full_like(want, 7.0)
    with pytest.raises(ValueError, match=r"counters must hold at least T \* cdiv\(H, 16\) = 6"):
        sparse_attention_triton(q, sources, sinks, 0.125, out=out,
                                counters=new_merge_counters(q.device, 5), **kw)  # fmt: skip
    assert (out == 7.0).all()
    for bad, err in ((torch.zeros(6, dtype=torch.int64), "dtype torch.int32"),
                     (torch.zeros(2, 3, dtype=torch.int32), "1-D"),
                     (torch.zeros(12, dtype=torch.int32)[::2], "contiguous")):  # fmt: skip
        with pytest.raises((TypeError, ValueError), match=f"counters must .*{err}"):
            sparse_attention(q, sources, sinks, 0.125, counters=bad)
    # one program a row (no split): any buffer size is fine
    got = sparse_attention_triton(q, sources, sinks, 0.125, tile_n=16, num_splits=1,
                                  counters=new_merge_counters(q.device, 1))  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_shared_merge_counters_per_device_and_stream() -> None:
    """The shared buffer: one a device (and CUDA stream), zeroed, ``MERGE_COUNTERS`` long."""
    from kvplan.ops._triton_util import MERGE_COUNTERS

    a, b = merge_counters("cpu"), merge_counters(torch.device("cpu"))
    assert a is b and a.shape == (MERGE_COUNTERS,) and a.dtype == torch.int32
    if torch.cuda.is_available():
        main = merge_counters("cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            side = merge_counters("cuda")
        assert main is not side and main is merge_counters("cuda")
        assert main is merge_counters(torch.device("cuda", torch.cuda.current_device()))


def _off_on(monkeypatch, switch: str, q, sources, sinks, scale=0.125, **kw):
    """``sparse_attention_triton`` with the ``kvplan.ops.sparse_attention`` switch ``switch``
    off, then on: ``(plain, got)``."""
    from kvplan.ops import sparse_attention as sa

    outs = []
    for on in (False, True):
        monkeypatch.setattr(sa, switch, on)
        outs.append(sparse_attention_triton(q, sources, sinks, scale, **kw))
    return outs


@interpreter
@pytest.mark.parametrize("nib", [False, True])
@pytest.mark.parametrize("num_splits,pv_split", [(1, 1), (3, 1), (3, 2)])
def test_fp4_f16_tiles_equal_the_reference(monkeypatch, num_splits, pv_split, nib) -> None:
    """fp4 records (e2m1, e4m3 scales) as fp16 tiles (``FP4_F16_TILES``, interpreter; in
    nibble order with ``FP4_NIBBLE_TILES``): the launch takes them and gives the attention of
    the bf16 query over the exact values, as the bf16 tiles do; a query of 2^20-sized values
    too (shifted into fp16's range), and one of 2^-20-sized values with the scale 2^20 times
    larger (shifted up out of fp16's subnormals, where its values would keep 4 bits)."""
    from kvplan.ops import sparse_attention as sa

    monkeypatch.setattr(sa, "FP4_NIBBLE_TILES", nib)
    taken = []
    real = sa.f16_tiles
    monkeypatch.setattr(sa, "f16_tiles", lambda *a: taken.append(real(*a)) or taken[-1])
    for big in (1.0, 2.0**20, 2.0**-20):
        q, sources, sinks = _inputs([FP4_64, FP4_64], 3, 18, 64, [20, 37], seed=17,
                                    dtype=torch.bfloat16)  # fmt: skip
        q = (q.float() * big).bfloat16()
        scale = 0.125 * (2.0**20 if big < 1 else 1.0)  # the small query's logits stay O(1)
        _hide_block(sources, 4, 12)
        plain, got = _off_on(monkeypatch, "FP4_F16_TILES", q, sources, sinks, scale, tile_n=16,
                             num_splits=num_splits, pv_split=pv_split)  # fmt: skip
        assert taken[-2:] == [0, 2 if nib else 1]
        want = sparse_attention_torch(q.float(), sources, sinks, scale)
        assert got.isfinite().all()
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_fp4_f16_tiles_only_where_they_apply(monkeypatch) -> None:
    """`f16_tiles`: only with the switch, a bf16 / fp16 query held whole, and e2m1 sources
    with e4m3 scales whose value runs are 4-byte aligned."""
    from kvplan.ops import sparse_attention as sa
    from kvplan.ops.sparse_sources import source_address

    q, sources, _ = _inputs([FP4_64, FP8_64], 1, 2, 64, [4, 4], seed=18)
    fp4, fp8 = (source_address(i, src, 64) for i, src in enumerate(sources))
    monkeypatch.setattr(sa, "FP4_F16_TILES", True)
    monkeypatch.setattr(sa, "FP4_NIBBLE_TILES", False)
    assert sa.f16_tiles(torch.bfloat16, [fp4], 64, 64, 0, 1) == 1
    assert sa.f16_tiles(torch.float16, [fp4, fp4], 64, 64, 0, 2) == 1
    monkeypatch.setattr(sa, "FP4_NIBBLE_TILES", True)
    assert sa.f16_tiles(torch.bfloat16, [fp4], 64, 64, 0, 1) == 2
    assert not sa.f16_tiles(torch.float32, [fp4], 64, 64, 0, 1)  # fp32 query
    assert not sa.f16_tiles(torch.bfloat16, [fp4], 64, 64, 32, 1)  # query in chunks
    assert not sa.f16_tiles(torch.bfloat16, [fp4, fp8], 64, 64, 0, 1)  # an fp8 source
    assert not sa.f16_tiles(torch.bfloat16, [fp4._replace(stride_token=38)], 64, 64, 0, 1)
    monkeypatch.setattr(sa, "FP4_F16_TILES", False)
    assert not sa.f16_tiles(torch.bfloat16, [fp4], 64, 64, 0, 1)


def test_env_flags(monkeypatch) -> None:
    """The 0 / 1 switches (``env_flag``): unset gives the default, else a clear error."""
    from kvplan.ops._dispatch import env_flag

    monkeypatch.delenv("KVPLAN_SPARSE_FUSED_COMBINE", raising=False)
    assert env_flag("KVPLAN_SPARSE_FUSED_COMBINE", False) is False
    assert env_flag("KVPLAN_SPARSE_FUSED_COMBINE", True) is True
    monkeypatch.setenv("KVPLAN_SPARSE_FUSED_COMBINE", "1")
    assert env_flag("KVPLAN_SPARSE_FUSED_COMBINE", False) is True
    monkeypatch.setenv("KVPLAN_SPARSE_FUSED_COMBINE", "yes")
    with pytest.raises(ValueError, match="KVPLAN_SPARSE_FUSED_COMBINE must be 0 or 1, got 'yes'"):
        env_flag("KVPLAN_SPARSE_FUSED_COMBINE", False)


def test_split_no_sinks_and_empty_rows() -> None:
    """No head has a sink and no row sees a key: zeros, not NaN."""
    q, sources, sinks = _inputs(["fp32"], 2, 2, 16, [40], seed=13)
    sources[0].index.fill_(-1)
    sinks.fill_(float("-inf"))
    got = sparse_attention_triton(q, sources, sinks, 0.25, tile_n=16, num_splits=3)
    assert torch.equal(got, torch.zeros_like(got))


def test_split_count() -> None:
    # 32 rows x 1 head group on 132 SMs, 640 columns in tiles of 32, rounded up: 5 splits
    # (160 programs, a second wave)
    assert split_count(32, 640, 32, 132, one_wave=False) == 5
    assert split_count(132, 640, 16, 132, one_wave=False) == 1  # already a full wave
    assert split_count(32, 32, 16, 132, one_wave=False) == 1  # too few columns to split
    assert split_count(1, 64, 16, 132, one_wave=False) == 2  # at least 2 tiles per split
    assert split_count(16, 4096, 32, 132, one_wave=False) == 9
    # one wave (the default): the splits rounded down, so that rows x splits <= SMs
    assert split_count(32, 640, 32, 132) == 4
    assert split_count(132, 640, 16, 132) == 1
    assert split_count(32, 32, 16, 132) == 1
    assert split_count(16, 4096, 32, 132, one_wave=True) == 8
    assert split_count(64, 4096, 32, 132, one_wave=True) == 2
    assert split_count(100, 4096, 32, 132, one_wave=True) == 1
    assert split_count(1, 64, 16, 132, one_wave=True) == 2  # still at least 2 tiles a split
    q, sources, sinks = _inputs(["fp32"], 2, 2, 16, [4], seed=0)
    with pytest.raises(ValueError, match="num_splits"):
        sparse_attention_triton(q, sources, sinks, 1.0, num_splits=0)


def test_default_tiling_table() -> None:
    """Measured launch tables: split calls on quantized records pipeline 3 stages, on bf16 /
    fp32 rows 2; one-program calls by source kind and program count."""
    from kvplan.ops import sparse_attention as sa

    assert sa.default_tiling(4, True) == {"tile_n": 64, "num_warps": 8, "num_stages": 3}
    assert sa.default_tiling(4, False) == {"tile_n": 64, "num_warps": 8, "num_stages": 2}
    assert sa.default_tiling(4, False, few=True) is sa.SPLIT_TILING_EXACT
    assert sa.default_tiling(1, True, few=True) is sa.ONE_PROGRAM_TILING_QUANTIZED
    assert sa.default_tiling(1, False, few=True) is sa.ONE_PROGRAM_TILING_FEW
    assert sa.default_tiling(1, False) is sa.ONE_PROGRAM_TILING
    # both split tables walk the tile split_count plans with
    assert sa.SPLIT_TILING["tile_n"] == sa.SPLIT_TILING_EXACT["tile_n"] == sa._SPLIT_TILE_N


# ---- index scores: the tensor-core kernel ---------------------------------------------------


@interpreter
@pytest.mark.parametrize("kind", ["mxfp8", "fp8_fp32sf", "exact"])
@pytest.mark.parametrize("tile_n,tiles", [(16, 1), (16, 3)])
def test_index_tc_kernel_bf16_queries_interpreter(kind, tile_n, tiles) -> None:
    """bf16 queries: the new kernel (several key tiles per program) and the legacy kernel
    equal the torch path (the interpreter multiplies in fp32)."""
    q, w, rows, idx = _index_inputs(kind, seed=14)
    q = q.bfloat16()
    src = rows.key_source(idx)
    want = index_scores(q, w, src)  # torch path on CPU
    got = index_scores_triton(q, w, src, tile_n=tile_n, tiles=tiles)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(index_scores_triton(q, w, src, legacy=True), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


# ---- sm_90 compiles ------------------------------------------------------------------------

_SRC = {f"{n}_ptr": t for n, t in (("c0", "*u8"), ("c1", "*u8"), ("i0", "*i32"), ("i1", "*i32"))}
_V41 = dict(KIND0=2, SF0=0, GS0=32, FLAT0=True, KIND1=2, SF1=0, GS1=32, FLAT1=True, bs0=128, bs1=32)


def test_split_kernels_compile_for_sm90() -> None:
    sig = {"q_ptr": "*bf16", "qk_scale": "fp32", **_SRC}
    for fused in (False, True):  # the fused merge with the model's out_rope
        fsig = dict(sig, out_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", cnt_ptr="*i32")
        compile_sm90(_ks.sparse_attention_split_kernel, "*fp32", fsig, HEAD_DIM=512, D_P2=512,
                     TILE_H=16, TILE_N=32, **_V41, HAS1=True, HW=True, DOT_BF16=True,
                     D_CHUNK=0, PV_SPLIT=1, INTERPRET=False, FUSED=fused,
                     HALF_RD=32 if fused else 0, F16=False)  # fmt: skip
    for half_rd in (0, 32):  # out_rope off / on (the model's 64 rotary channels)
        compile_sm90(_ks.sparse_attention_combine_kernel, "*fp32",
                     {"out_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
                     HEAD_DIM=512, D_P2=512, TILE_H=16, INTERPRET=False, HALF_RD=half_rd,
                     HW=True)  # fmt: skip


@pytest.mark.parametrize("sf,gs,flat", [(0, 32, True), (2, 128, True)], ids=["ue8m0", "fp32"])
def test_index_tc_kernel_compiles_for_sm90(sf, gs, flat) -> None:
    sig = {"q_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "c_ptr": "*u8"}
    compile_sm90(_k.index_scores_tc_kernel, "*i32", sig, HEAD_DIM=128, D_P2=128, TILE_H=32,
                 TILE_N=128, TILES=2, KIND=2, SF=sf, GS=gs, FLAT=flat, HW=True,
                 DOT_BF16=True, block_size=32)  # fmt: skip


# ---- CUDA at DeepSeek-V4 shapes ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_split_v4_shapes(num_splits, dtype) -> None:
    q, sources, sinks = _v4_inputs(8, 16, 128, 512, V41_FORMAT, dtype, seed=21)
    sources[1].index[:3] = -1  # rows 0..2 see only the ring
    got = sparse_attention_triton(q, sources, sinks, 512**-0.5, num_splits=num_splits)
    want = sparse_attention_torch(q, sources, sinks, 512**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    one = sparse_attention(q, sources, sinks, 512**-0.5)  # default dispatch (auto split)
    torch.testing.assert_close(one.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mxfp8", "fp8_fp32sf", "fp4", "exact"])
def test_cuda_index_scores_bf16_tensor_cores(kind) -> None:
    """bf16 queries on the tensor cores: exact products, fp32 sums in another order."""
    from kvplan.backends.hybrid.storage import PagedRows, index_format

    gen = torch.Generator().manual_seed(22)
    fmt = index_format("exact" if kind == "exact" else "fp8", None if kind == "exact" else kind,
                       128, torch.bfloat16)  # fmt: skip
    rows = PagedRows(64, 64, fmt, 128, device=torch.device("cuda"))
    rows.store(torch.randn(4096, 128, generator=gen).cuda(),
               torch.arange(4096, dtype=torch.int32, device="cuda"))  # fmt: skip
    q = torch.randn(8, 32, 128, generator=gen).cuda().bfloat16()
    w = torch.randn(8, 32, generator=gen).cuda()
    idx = torch.randint(-1, 4096, (8, 3000), generator=gen, dtype=torch.int32).cuda()
    src = rows.key_source(idx)
    got = index_scores(q, w, src)
    keys = rows.load_slots(idx).view(*idx.shape, -1)
    want = torch.einsum("thk,th->tk", torch.einsum("thc,tkc->thk", q.float(), keys).relu(), w)
    want = want.masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    legacy = index_scores_triton(q, w, src, legacy=True)
    torch.testing.assert_close(got, legacy, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
def test_cuda_split_in_a_cuda_graph() -> None:
    """The split path (workspace allocated per call) captures and replays as a CUDA graph."""
    q, sources, sinks = _v4_inputs(4, 16, 128, 256, V41_FORMAT, torch.bfloat16, seed=23)
    eager = sparse_attention_triton(q, sources, sinks, 512**-0.5, check=False, num_splits=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse_attention_triton(q, sources, sinks, 512**-0.5, check=False, num_splits=6)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention_triton(q, sources, sinks, 512**-0.5, check=False, num_splits=6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _v4_rope_inputs(layout, seed):
    """`_v4_inputs` of 8 rows x 16 heads (ring 128, pool 512, bf16 queries; rows 0..2 see only
    the ring) and the output's RoPE tables (``[8, 32]`` cos / sin, bf16)."""
    q, sources, sinks = _v4_inputs(8, 16, 128, 512, layout, torch.bfloat16, seed=seed)
    sources[1].index[:3] = -1
    ang = torch.rand(8, 32, generator=torch.Generator().manual_seed(seed + 1)) * 6.3
    return q, sources, sinks, (ang.cos().bfloat16().cuda(), ang.sin().bfloat16().cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [3, 40])
def test_cuda_fused_merge_equals_combine_kernel_and_replays(monkeypatch, num_splits) -> None:
    """On the GPU the last-arriving program's merge (``FUSED_COMBINE``) gives the combine
    kernel's bits at the DeepSeek-V4 shapes, with the output's inverse RoPE, eagerly and in
    CUDA-graph replays (the counters are left zeroed between them)."""
    from kvplan.ops import sparse_attention as sa

    q, sources, sinks, rope = _v4_rope_inputs(V41_FORMAT, seed=24)
    kw = dict(check=False, num_splits=num_splits, out_rope=rope)
    monkeypatch.setattr(sa, "FUSED_COMBINE", False)
    want = sparse_attention_triton(q, sources, sinks, 512**-0.5, **kw)
    monkeypatch.setattr(sa, "FUSED_COMBINE", True)
    got = sparse_attention_triton(q, sources, sinks, 512**-0.5, **kw)
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention_triton(q, sources, sinks, 512**-0.5, **kw)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert not merge_counters(q.device).any()


@pytest.mark.gpu
@pytest.mark.parametrize("nib", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_cuda_fp4_f16_tiles_v4_shapes(monkeypatch, num_splits, nib) -> None:
    """V41 FP4 records at the DeepSeek-V4 shapes on fp16 tiles (in nibble order with
    ``FP4_NIBBLE_TILES``: values 2^-14 small, fp16 subnormals in the MMAs), one program and
    split, against the reference and the bf16 tiles, with the output's inverse RoPE."""
    from kvplan.formats import V41_FP4_FORMAT
    from kvplan.ops import sparse_attention as sa

    q, sources, sinks, rope = _v4_rope_inputs(V41_FP4_FORMAT, seed=26)
    monkeypatch.setattr(sa, "FP4_NIBBLE_TILES", nib)
    plain, got = _off_on(monkeypatch, "FP4_F16_TILES", q, sources, sinks, 512**-0.5,
                         check=False, num_splits=num_splits, out_rope=rope)  # fmt: skip
    want = sparse_attention_torch(q, sources, sinks, 512**-0.5, out_rope=rope)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), plain.float(), atol=2e-2, rtol=2e-2)
