"""sparse_attention: the torch path equals a float64 per-row loop; the Triton kernel (CPU
interpreter on tiny shapes, CUDA at DeepSeek-V4 shapes) equals the torch path, for plain
fp32 / bf16 rows, plain paged caches and V41-style quantized caches read in place."""

from __future__ import annotations

import pytest
import torch

from kvplan.formats import V41_FORMAT, V41_FP4_FORMAT, KVCacheFormat, alloc_kv_cache
from kvplan.ops import store_kv_cache
from kvplan.ops.sparse_attention import (
    KeySource,
    gather_rows,
    sparse_attention,
    sparse_attention_ref,
    sparse_attention_torch,
    sparse_attention_triton,
)

FP8_64 = KVCacheFormat("e4m3", 64, 32, 0, True, "ue8m0", "fp8 x64", True)
FP8_48 = KVCacheFormat("e4m3", 48, 32, 0, True, "ue8m0", "fp8 x48, short last group", True)
FP4_64 = KVCacheFormat("e2m1", 64, 16, 0, True, "e4m3", "fp4 x64", True)


def _index(gen, num_rows, width, num_slots, device="cpu"):
    """int32 [T, K] random slots with about a third ``-1``; row 0 sees nothing."""
    idx = torch.randint(0, num_slots, (num_rows, width), generator=gen, dtype=torch.int32)
    hide = torch.rand(num_rows, width, generator=gen) < 0.35
    idx = torch.where(hide, -1, idx)
    idx[0] = -1
    return idx.to(device)


def make_source(kind, gen, num_rows, width, head_dim, device="cpu"):
    """A source of ``kind`` ("fp32", "bf16", "paged_bf16", "paged_fp32", or a quantized
    layout) with random contents and a random index."""
    num_blocks, block_size = 6, 8
    num_slots = num_blocks * block_size
    rows = torch.randn(num_slots, head_dim, generator=gen) * 2
    idx = _index(gen, num_rows, width, num_slots, device)
    if kind == "fp32":
        return KeySource(rows.to(device), idx)
    if kind == "bf16":
        return KeySource(rows.to(device, torch.bfloat16), idx)
    if kind in ("paged_bf16", "paged_fp32"):
        dtype = torch.bfloat16 if kind == "paged_bf16" else torch.float32
        pad = torch.zeros(num_blocks, block_size + 3, 1, head_dim, dtype=dtype)  # block stride
        pad[:, :block_size, 0] = rows.view(num_blocks, block_size, head_dim).to(dtype)
        return KeySource(pad[:, :block_size].to(device), idx)
    layout = kind
    cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
    cache.zero_()
    slots = torch.arange(num_slots, dtype=torch.int32, device=device)
    store_kv_cache(rows.to(device, torch.bfloat16), cache, slots, layout=layout)
    return KeySource(cache, idx, layout)


KINDS = ["fp32", "bf16", "paged_bf16", "paged_fp32", FP8_64, FP4_64]


def _ids(k):
    return k if isinstance(k, str) else k.note


def _inputs(kinds, num_rows, num_heads, head_dim, widths, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(num_rows, num_heads, head_dim, generator=gen) * 0.5).to(device, dtype)
    sinks = torch.randn(num_heads, generator=gen).to(device)
    sources = [make_source(k, gen, num_rows, w, head_dim, device) for k, w in zip(kinds, widths)]
    return q, sources, sinks


@pytest.mark.parametrize("kind", KINDS, ids=_ids)
def test_torch_equals_ref(kind) -> None:
    q, sources, sinks = _inputs([kind, "fp32"], 5, 3, 64, [7, 4], seed=1)
    got = sparse_attention_torch(q, sources, sinks, 0.125)
    want = sparse_attention_ref(q, sources, sinks, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # sees nothing: sink only
    assert sparse_attention(q, sources, sinks, 0.125).equal(got)  # CPU dispatch


def test_quantized_rows_are_the_stored_rows() -> None:
    """gather_rows of a quantized cache is the rounding of the stored rows, not the rows."""
    gen = torch.Generator().manual_seed(2)
    src = make_source(FP8_64, gen, 2, 4, 64)
    rows = gather_rows(src, torch.tensor([[3, -1]], dtype=torch.int32))
    assert rows.shape == (1, 2, 64) and torch.equal(rows[0, 1], torch.zeros(64))
    assert rows[0, 0].abs().sum() > 0


def test_checks() -> None:
    q, sources, sinks = _inputs(["fp32"], 3, 2, 16, [4], seed=3)
    bad = KeySource(sources[0].cache, sources[0].index.long())
    with pytest.raises(TypeError, match="index"):
        sparse_attention(q, [bad], sinks, 1.0)
    over = KeySource(sources[0].cache, torch.full((3, 2), 48, dtype=torch.int32))
    with pytest.raises(ValueError, match="index"):
        sparse_attention(q, [over], sinks, 1.0)
    with pytest.raises(ValueError, match="1 or 2"):
        sparse_attention(q, sources * 3, sinks, 1.0)
    with pytest.raises(ValueError, match="sinks"):
        sparse_attention(q, sources, sinks[:1], 1.0)
    with pytest.raises(ValueError, match="elements"):
        gen = torch.Generator().manual_seed(0)
        sparse_attention(q, [make_source(FP8_64, gen, 3, 2, 64)], sinks, 1.0)


# ---- Triton kernel in the CPU interpreter (tiny shapes) ----------------------------------


@pytest.mark.parametrize(
    "kinds,head_dim",
    [
        (["fp32", "paged_fp32"], 32),
        (["paged_bf16", FP8_64], 64),
        ([FP4_64, "bf16"], 64),
        ([FP8_48], 48),
    ],
    ids=["fp32", "bf16_fp8", "fp4_bf16", "fp8_x48"],
)
def test_triton_interpreter_equals_torch(kinds, head_dim) -> None:
    widths = [5, 19][: len(kinds)]
    q, sources, sinks = _inputs(kinds, 3, 2, head_dim, widths, seed=4)
    got = sparse_attention_triton(q, sources, sinks, head_dim**-0.5, tile_n=16)
    want = sparse_attention_torch(q, sources, sinks, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_triton_interpreter_bf16_queries() -> None:
    """bf16 q and out: the bf16 dots the GPU takes (the interpreter's, fixed by
    kvplan.ops._interpreter_bf16), within bf16 tolerance of the fp32 torch path."""
    q, sources, sinks = _inputs([FP8_64], 2, 3, 64, [9], seed=5, dtype=torch.bfloat16)
    got = sparse_attention_triton(q, sources, sinks, 0.125, tile_n=16)
    want = sparse_attention_torch(q, sources, sinks, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# ---- CUDA at DeepSeek-V4 shapes ------------------------------------------------------------


def _v4_inputs(num_rows, num_heads, ring_width, pool_width, layout, dtype, seed):
    """q [T, H, 512]; a ring of 64 slots per row and a pool, both in ``layout`` (None: fp32
    rows), read through random slot tables of the given widths."""
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    q = (torch.randn(num_rows, num_heads, 512, generator=gen) * 0.3).to(dev, dtype)
    sinks = torch.randn(num_heads, generator=gen).to(dev)
    sources = []
    for width, num_blocks, block_size in ((ring_width, num_rows, 128), (pool_width, 257, 64)):
        n = num_blocks * block_size
        rows = torch.randn(n, 512, generator=gen).to(dev)
        idx = torch.randint(0, n, (num_rows, width), generator=gen, dtype=torch.int32)
        idx = torch.where(torch.rand(num_rows, width, generator=gen) < 0.2, -1, idx).to(dev)
        if layout is None:
            sources.append(KeySource(rows, idx))
            continue
        cache = alloc_kv_cache(num_blocks, block_size, layout, device=dev)
        store_kv_cache(rows.to(torch.bfloat16), cache, torch.arange(n, dtype=torch.int32,
                       device=dev), layout=layout)  # fmt: skip
        sources.append(KeySource(cache, idx, layout))
    return q, sources, sinks


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 64])
@pytest.mark.parametrize(
    "layout", [V41_FORMAT, V41_FP4_FORMAT, None], ids=["v41", "v41fp4", "fp32"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_v4_shapes(num_heads, layout, dtype) -> None:
    q, sources, sinks = _v4_inputs(24, num_heads, 128, 512, layout, dtype, seed=num_heads)
    got = sparse_attention(q, sources, sinks, 512**-0.5)
    want = sparse_attention_torch(q, sources, sinks, 512**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_cuda_one_source_many_rows() -> None:
    """Prefill-like: 300 rows, one fp32 source of 640 columns, 32 heads."""
    q, sources, sinks = _v4_inputs(300, 32, 640, 16, None, torch.bfloat16, seed=7)
    got = sparse_attention(q, sources[:1], sinks, 512**-0.5)
    want = sparse_attention_torch(q, sources[:1], sinks, 512**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# ---- the indexer's scores ------------------------------------------------------------------

INDEX_KINDS = ["mxfp8", "fp8_fp32sf", "fp4", "exact"]


def _index_inputs(kind, seed, width=32, device="cpu"):
    """index_q [3, 4, width], weights, and a PagedRows of index keys with a slot table."""
    from kvplan.backends.hybrid.storage import PagedRows, index_format

    gen = torch.Generator().manual_seed(seed)
    fmt = index_format("exact" if kind == "exact" else "fp8", None if kind == "exact" else kind,
                       width, torch.float32)  # fmt: skip
    rows = PagedRows(5, 8, fmt, width, device=torch.device(device))
    rows.store(torch.randn(40, width, generator=gen).to(device),
               torch.arange(40, dtype=torch.int32, device=device))  # fmt: skip
    q = torch.randn(3, 4, width, generator=gen).to(device)
    w = torch.randn(3, 4, generator=gen).to(device)
    idx = _index(gen, 3, 20, 40, device)
    return q, w, rows, idx


def _scores_via_load(q, w, rows, idx):
    """Independent path: load_paged_kv_cache (+ index dequantization), then dense einsum."""
    keys = rows.load_slots(idx).view(*idx.shape, -1)
    s = torch.einsum("thk,th->tk", torch.einsum("thc,tkc->thk", q, keys).relu(), w)
    return s.masked_fill(idx < 0, float("-inf"))


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_index_scores_torch(kind) -> None:
    from kvplan.ops.sparse_attention import index_scores

    q, w, rows, idx = _index_inputs(kind, seed=8)
    got = index_scores(q, w, rows.key_source(idx))
    torch.testing.assert_close(got, _scores_via_load(q, w, rows, idx), atol=1e-5, rtol=1e-5)
    assert torch.isinf(got[0]).all() and torch.isfinite(got[idx >= 0]).all()


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_index_scores_triton_interpreter(monkeypatch, kind) -> None:
    from kvplan.ops.sparse_attention import index_scores

    q, w, rows, idx = _index_inputs(kind, seed=9)
    want = index_scores(q, w, rows.key_source(idx))
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    got = index_scores(q, w, rows.key_source(idx))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_topk_columns() -> None:
    from kvplan.ops.sparse_attention import topk_columns

    scores = torch.tensor([[0.5, 3.0, -1.0, 2.0], [1.0, 0.0, 9.0, 9.5]])
    got = topk_columns(scores, torch.tensor([4, 2], dtype=torch.int32), 3)
    assert got.tolist() == [[0, 1, 3], [0, 1, -1]]  # column order


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_index_scores_cuda(kind) -> None:
    """128-wide keys, 32 heads, a few thousand candidates per row."""
    from kvplan.backends.hybrid.storage import PagedRows, index_format
    from kvplan.ops.sparse_attention import index_scores

    gen = torch.Generator().manual_seed(10)
    fmt = index_format("exact" if kind == "exact" else "fp8", None if kind == "exact" else kind,
                       128, torch.bfloat16)  # fmt: skip
    rows = PagedRows(64, 64, fmt, 128, device=torch.device("cuda"))
    rows.store(torch.randn(4096, 128, generator=gen).cuda(),
               torch.arange(4096, dtype=torch.int32, device="cuda"))  # fmt: skip
    q = torch.randn(8, 32, 128, generator=gen).cuda()
    w = torch.randn(8, 32, generator=gen).cuda()
    idx = torch.randint(-1, 4096, (8, 3000), generator=gen, dtype=torch.int32).cuda()
    got = index_scores(q, w, rows.key_source(idx))
    torch.testing.assert_close(got, _scores_via_load(q, w, rows, idx), atol=1e-3, rtol=1e-4)
