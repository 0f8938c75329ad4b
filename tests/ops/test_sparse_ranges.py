"""sparse_attention_ranges: ranges expand to the index tables they stand for; the torch path
equals the float64 per-row loop over that index; the Triton kernel (CPU interpreter on tiny
shapes, CUDA at DeepSeek-V4 prompt shapes) equals the torch path, with blocks sharing their
key tiles, for plain rows, paged and quantized caches, and the inverse rotation. Also the
row list of ``sparse_attention`` (the other rows untouched)."""

from __future__ import annotations

import pytest
import torch

from kvplan.formats import V41_FORMAT, alloc_kv_cache
from kvplan.ops import store_kv_cache
from kvplan.ops.rope import norm_rope_torch
from kvplan.ops.sparse_attention import (
    KeySource,
    sparse_attention,
    sparse_attention_ref,
    sparse_attention_torch,
)
from kvplan.ops.sparse_ranges import (
    RangeSource,
    ranges_index,
    sparse_attention_ranges,
    sparse_attention_ranges_torch,
    sparse_attention_ranges_triton,
)
from tests.ops.test_sparse_attention import FP8_64


def _window_ranges(seqlens, window, hist):
    """Prompt-like SWA ranges of one buffer ``[n * hist history rows | chunk rows]``: row k of
    sequence i (``hist`` earlier tokens) sees its last ``window`` positions, split into a
    history range and a chunk range."""
    n, out, base = len(seqlens), [], 0
    for i, length in enumerate(seqlens):
        for k in range(length):
            lo = k + 1 - window  # first position seen, relative to the chunk start
            h_len = max(0, min(hist, -lo))
            out.append(
                [(i + 1) * hist - h_len, h_len, n * hist + base + max(lo, 0), k + 1 - max(lo, 0)]
            )
        base += length
    return torch.tensor(out, dtype=torch.int32)


def _prefix_ranges(seqlens, ratio, gen):
    """Compressed-prefix ranges: row k of sequence i sees entries ``[ks_i, ks_i + (k + 1) //
    ratio)`` plus a few random extra rows at its start (gaps between sequences)."""
    out, base = [], 0
    for length in seqlens:
        for k in range(length):
            out.append([base, (k + 1) // ratio])
        base += length // ratio + int(torch.randint(0, 3, (1,), generator=gen))
    return torch.tensor(out, dtype=torch.int32), base


def _cache(kind, num_slots, head_dim, gen, device="cpu"):
    rows = torch.randn(num_slots, head_dim, generator=gen) * 2
    if kind == "fp32":
        return rows.to(device), None
    if kind == "bf16":
        return rows.to(device, torch.bfloat16), None
    bs = 8
    nb = -(-num_slots // bs)
    cache = alloc_kv_cache(nb, bs, kind, device=device)
    cache.zero_()
    slots = torch.arange(num_slots, dtype=torch.int32, device=device)
    store_kv_cache(rows.to(device, torch.bfloat16), cache, slots, layout=kind)
    return cache, kind


def _inputs(seqlens, heads, head_dim, kinds, seed, dtype=torch.float32, device="cpu",
            window=6, ratio=3):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    t = sum(seqlens)
    q = (torch.randn(t, heads, head_dim, generator=gen) * 0.5).to(device, dtype)
    sinks = torch.randn(heads, generator=gen).to(device)
    hist = window - 1
    win = _window_ranges(seqlens, window, hist)
    c0, l0 = _cache(kinds[0], len(seqlens) * hist + t, head_dim, gen, device)
    sources = [RangeSource(c0, win.to(device), l0)]
    if len(kinds) > 1:
        pre, n = _prefix_ranges(seqlens, ratio, gen)
        c1, l1 = _cache(kinds[1], max(n, 1), head_dim, gen, device)
        sources.append(RangeSource(c1, pre.to(device), l1))
    return q, sources, sinks


def _keys(sources):
    return [KeySource(s.cache, ranges_index(s.ranges), s.layout) for s in sources]


def test_ranges_index() -> None:
    r = torch.tensor([[4, 2, 9, 1], [0, 0, 3, 3], [7, 0, 0, 0]], dtype=torch.int32)
    want = torch.tensor([[4, 5, 9, -1], [3, 4, 5, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    assert torch.equal(ranges_index(r), want[:, :3])
    assert ranges_index(torch.zeros(2, 2, dtype=torch.int32)).equal(
        torch.full((2, 1), -1, dtype=torch.int32)
    )


def test_torch_equals_ref() -> None:
    q, sources, sinks = _inputs([7, 5], 3, 64, ["fp32", FP8_64], seed=1)
    got = sparse_attention_ranges(q, sources, sinks, 0.2)
    want = sparse_attention_ref(q, _keys(sources), sinks, 0.2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kinds,dtype,tile_t,tile_h",
    [
        (["fp32", "fp32"], torch.float32, 4, 4),
        (["bf16", FP8_64], torch.bfloat16, 8, 2),
        (["bf16"], torch.bfloat16, 2, 8),
    ],
    ids=["fp32", "bf16_fp8", "window_only"],
)
def test_triton_interpreter_equals_torch(kinds, dtype, tile_t, tile_h) -> None:
    head_dim = 64 if FP8_64 in kinds else 32
    q, sources, sinks = _inputs([9, 4, 6], 2, head_dim, kinds, seed=2, dtype=dtype)
    got = sparse_attention_ranges_triton(q, sources, sinks, 0.2, tile_t=tile_t, tile_h=tile_h,
                                         tile_n=16, num_warps=4)  # fmt: skip
    want = sparse_attention_torch(q, _keys(sources), sinks, 0.2)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_interpreter_blocks_and_rope() -> None:
    """Blocks of one sequence's rows (a row left out stays untouched) and the epilogue's
    inverse rotation: the torch path's rows, then ``norm_rope(inverse=True)``."""
    q, sources, sinks = _inputs([5, 6], 2, 32, ["fp32", "fp32"], seed=3)
    start = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    end = torch.tensor([4, 5, 9, 10], dtype=torch.int32)  # row 10 in no block
    gen = torch.Generator().manual_seed(4)
    cos, sin = torch.rand(11, 8, generator=gen), torch.rand(11, 8, generator=gen)
    out = torch.full_like(q, 7.0)
    got = sparse_attention_ranges_triton(q, sources, sinks, 0.3, blocks=(start, end), out=out,
                                         out_rope=(cos, sin), tile_t=4, tile_h=4, tile_n=16,
                                         num_warps=4)  # fmt: skip
    plain = sparse_attention_torch(q, _keys(sources), sinks, 0.3)
    want = norm_rope_torch(plain, cos, sin, inverse=True)
    torch.testing.assert_close(got[:10], want[:10], atol=2e-5, rtol=2e-5)
    assert torch.equal(got[10], torch.full_like(got[10], 7.0))
    torch_got = sparse_attention_ranges_torch(q, sources, sinks, 0.3, blocks=(start, end),
                                              out=torch.full_like(q, 7.0),
                                              out_rope=(cos, sin))  # fmt: skip
    torch.testing.assert_close(torch_got, got, atol=2e-5, rtol=2e-5)


def test_checks() -> None:
    q, sources, sinks = _inputs([4], 2, 16, ["fp32"], seed=5)
    src = sources[0]
    bad = RangeSource(src.cache, torch.tensor([[0, 2, 0, 99]] * 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sources\[0\].ranges row 0 pair 1"):
        sparse_attention_ranges(q, [bad], sinks, 1.0)
    neg = RangeSource(src.cache, torch.tensor([[0, -1]] * 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="length -1"):
        sparse_attention_ranges(q, [neg], sinks, 1.0)
    with pytest.raises(ValueError, match="pairs"):
        sparse_attention_ranges(q, [RangeSource(src.cache, src.ranges[:, :3].contiguous())],
                                sinks, 1.0)  # fmt: skip
    with pytest.raises(TypeError, match="RangeSource"):
        sparse_attention_ranges(q, [KeySource(src.cache, src.ranges)], sinks, 1.0)
    with pytest.raises(ValueError, match="rows"):
        sparse_attention_ranges(q, [RangeSource(src.cache, src.ranges[:2])], sinks, 1.0)
    blocks = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"blocks\[1\] = \[3, 5\)"):
        sparse_attention_ranges(q, sources, sinks, 1.0, blocks=blocks)
    with pytest.raises(ValueError, match="tile_t = 2"):
        sparse_attention_ranges_triton(q, sources, sinks, 1.0, tile_t=2, tile_h=8,
                                       blocks=(blocks[0][:1], blocks[0][:1] + 3))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        sparse_attention_ranges_triton(q, sources, sinks, 1.0, tile_t=3)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "interpreter"])
def test_sparse_attention_rows(use_kernel, monkeypatch) -> None:
    """``rows``: only the listed rows are computed (equal to the full call's), the rest of out
    is left as it was."""
    q, sources, sinks = _inputs([5, 4], 2, 32, ["fp32", "fp32"], seed=6)
    keys = _keys(sources)
    rows = torch.tensor([7, 0, 3], dtype=torch.int32)
    if use_kernel:
        monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    out = torch.full_like(q, -3.0)
    got = sparse_attention(q, keys, sinks, 0.25, out=out, rows=rows)
    full = sparse_attention_torch(q, keys, sinks, 0.25)
    torch.testing.assert_close(got[rows.long()], full[rows.long()], atol=2e-5, rtol=2e-5)
    rest = torch.ones(q.shape[0], dtype=torch.bool)
    rest[rows.long()] = False
    assert torch.equal(got[rest], torch.full_like(got[rest], -3.0))
    with pytest.raises(ValueError, match="rows"):
        sparse_attention(q, keys, sinks, 0.25, rows=torch.tensor([9], dtype=torch.int32))


# ---- CUDA at DeepSeek-V4 prompt shapes -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [V41_FORMAT, None], ids=["v41", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_prompt_shapes(layout, dtype) -> None:
    """16 heads x 512, window 128, ratio 4 prefixes, three sequences (one chunk continuing
    after 40 history rows): the kernel within bf16 tolerance of the torch path."""
    kinds = ["bf16", layout or "bf16"]
    q, sources, sinks = _inputs([300, 77, 160], 16, 512, kinds, seed=8, dtype=dtype,
                                device="cuda", window=128, ratio=4)  # fmt: skip
    got = sparse_attention_ranges(q, sources, sinks, 512**-0.5)
    want = sparse_attention_torch(q, _keys(sources), sinks, 512**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
