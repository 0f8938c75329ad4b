"""``index_scores_by_sequence``: the indexer's scores of prompt rows that share their
sequence's candidates (a key tile loaded once for several rows), against :func:`index_scores`
over the per-row table and an independent load + einsum: every index layout, sequences of
one or many rows, rows seeing no candidate, hidden slots; errors; the engine's prompt path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplan.ops.index_scores import index_scores, index_scores_by_sequence
from kvplan.ops.sparse_sources import KeySource

KINDS = ["mxfp8", "fp8_fp32sf", "fp4", "exact"]


def _inputs(kind, seed, seq_rows=(5, 1, 9), num_cols=37, width=32, heads=4, dtype=torch.float32):
    from kvplan.backends.hybrid.storage import PagedRows, index_format

    gen = torch.Generator().manual_seed(seed)
    fmt = index_format("exact" if kind == "exact" else "fp8", None if kind == "exact" else kind,
                       width, torch.float32)  # fmt: skip
    rows = PagedRows(8, 8, fmt, width, device=torch.device("cpu"))
    rows.store(torch.randn(64, width, generator=gen), torch.arange(64, dtype=torch.int32))
    num_rows = sum(seq_rows)
    q = torch.randn(num_rows, heads, width, generator=gen).to(dtype)
    w = torch.randn(num_rows, heads, generator=gen)
    # each sequence's candidates: distinct slots, a few hidden (-1)
    idx = torch.stack([torch.randperm(64, generator=gen)[:num_cols] for _ in seq_rows])
    idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.15, -1, idx).to(torch.int32)
    cu = np.concatenate([[0], np.cumsum(seq_rows)])
    # lengths rise along each sequence's rows (as prompt rows see more closed entries)
    lens = torch.cat([torch.sort(torch.randint(0, num_cols + 1, (n,), generator=gen))[0]
                      for n in seq_rows]).to(torch.int32)  # fmt: skip
    lens[0] = 0  # a row that sees nothing
    return q, w, rows, idx, cu, lens


def _per_row(idx, cu, lens):
    row_seq = torch.from_numpy(np.repeat(np.arange(idx.shape[0]), np.diff(cu)))
    col = torch.arange(idx.shape[1])[None, :]
    return torch.where(col < lens.long()[:, None], idx[row_seq], -1).to(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_kernel_equals_index_scores_over_the_per_row_table(kind, rows_per_program, monkeypatch):
    q, w, rows, idx, cu, lens = _inputs(kind, seed=KINDS.index(kind))
    table = _per_row(idx, cu, lens)
    want = index_scores(q, w, rows.key_source(table))  # torch path
    keys = rows.load_slots(table).view(*table.shape, -1)  # independent: load + einsum
    dense = torch.einsum("thk,th->tk", torch.einsum("thc,tkc->thk", q, keys).relu(), w)
    torch.testing.assert_close(want, dense.masked_fill(table < 0, float("-inf")),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    got_torch = index_scores_by_sequence(q, w, rows.key_source(idx), cu, lens)
    assert torch.equal(got_torch, want)
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    got = index_scores_by_sequence(q, w, rows.key_source(idx), cu, lens,
                                   rows_per_program=rows_per_program, tile_n=16)  # fmt: skip
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got[0]).all()  # row 0 sees nothing
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_queries_and_a_partial_tile(monkeypatch):
    q, w, rows, idx, cu, lens = _inputs("mxfp8", seed=7, seq_rows=(3, 6), num_cols=21,
                                        dtype=torch.bfloat16)  # fmt: skip
    want = index_scores(q, w, rows.key_source(_per_row(idx, cu, lens)))
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    got = index_scores_by_sequence(q, w, rows.key_source(idx), cu, lens, tile_n=16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_inputs():
    q, w, rows, idx, cu, lens = _inputs("exact", seed=3)
    src = rows.key_source(idx)
    with pytest.raises(ValueError, match="cu_rows must have 4 entries"):
        index_scores_by_sequence(q, w, src, cu[:-1], lens)
    with pytest.raises(ValueError, match="cu_rows must rise from 0 to 15"):
        index_scores_by_sequence(q, w, src, np.array([0, 6, 5, 15]), lens)
    with pytest.raises(TypeError, match="lens must have dtype"):
        index_scores_by_sequence(q, w, src, cu, lens.long())
    bad = lens.clone()
    bad[3] = idx.shape[1] + 1
    with pytest.raises(ValueError, match="lens"):
        index_scores_by_sequence(q, w, src, cu, bad)
    hidden = idx.clone()
    hidden[0, 0] = 64  # a slot past the cache
    with pytest.raises(ValueError, match="keys.index"):
        index_scores_by_sequence(q, w, KeySource(src.cache, hidden, src.layout), cu, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_prompt_shapes(kind):
    """32 heads x 128, 1,024 candidates, two prompts of 300 / 77 rows, bf16 queries."""
    from kvplan.backends.hybrid.storage import PagedRows, index_format

    gen = torch.Generator().manual_seed(11)
    fmt = index_format("exact" if kind == "exact" else "fp8", None if kind == "exact" else kind,
                       128, torch.bfloat16)  # fmt: skip
    rows = PagedRows(40, 64, fmt, 128, device=torch.device("cuda"))
    rows.store(torch.randn(2560, 128, generator=gen).cuda(),
               torch.arange(2560, dtype=torch.int32, device="cuda"))  # fmt: skip
    seq_rows = (300, 77)
    q = torch.randn(sum(seq_rows), 32, 128, generator=gen).bfloat16().cuda()
    w = torch.randn(sum(seq_rows), 32, generator=gen).cuda()
    idx = torch.stack([torch.randperm(2560, generator=gen)[:1024] for _ in seq_rows])
    idx = idx.to(torch.int32).cuda()
    cu = np.array([0, 300, 377])
    lens = torch.cat([torch.linspace(0, 1024, n).to(torch.int32) for n in seq_rows]).cuda()
    want = index_scores(q, w, rows.key_source(_per_row(idx.cpu(), cu, lens.cpu()).cuda()))
    got = index_scores_by_sequence(q, w, rows.key_source(idx), cu, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=2e-3, rtol=2e-3)


def test_empty_shapes_and_a_sequence_without_rows(monkeypatch):
    q, w, rows, idx, cu, lens = _inputs("mxfp8", seed=5, seq_rows=(4, 3))
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    # no candidates yet (a prompt shorter than one entry): [T, 0]
    none = rows.key_source(idx[:, :0].contiguous())
    got = index_scores_by_sequence(q, w, none, cu, torch.zeros_like(lens))
    assert got.shape == (7, 0)
    # a sequence that owns no row of the step between two that do
    idx3 = torch.cat([idx[:1], idx[:1], idx[1:]], 0)  # [3, K]: the middle one owns no row
    cu3 = np.array([0, 4, 4, 7])
    got = index_scores_by_sequence(q, w, rows.key_source(idx3), cu3, lens)
    want = index_scores_by_sequence(q, w, rows.key_source(idx), cu, lens)
    assert torch.equal(got, want)
