"""The indexer's key tile (``kvplan.ops.index_scores.TC_TILE_N``, ``KVPLAN_INDEX_TILE_N``):
scores by tiles of the default 64 keys equal those by tiles of 128 and the einsum over the
loaded keys; a bad setting names its variable."""

from __future__ import annotations

import importlib

import pytest
import torch

import kvplan.ops.index_scores as ix


def _case(seed: int, rows: int = 3, cols: int = 150, width: int = 128, heads: int = 8):
    from kvplan.backends.hybrid.storage import PagedRows, index_format

    gen = torch.Generator().manual_seed(seed)
    fmt = index_format("fp8", "mxfp8", width, torch.float32)
    keys = PagedRows(8, 32, fmt, width, device=torch.device("cpu"))
    keys.store(torch.randn(256, width, generator=gen), torch.arange(256, dtype=torch.int32))
    q = torch.randn(rows, heads, width, generator=gen).to(torch.bfloat16)
    w = torch.randn(rows, heads, generator=gen)
    idx = torch.stack([torch.randperm(256, generator=gen)[:cols] for _ in range(rows)])
    idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.1, -1, idx).to(torch.int32)
    return q, w, keys, idx


def test_default_tile_equals_128_and_the_reference(monkeypatch):
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    q, w, keys, idx = _case(3)
    src = keys.key_source(idx)
    assert ix.TC_TILE_N == 64
    got = ix.index_scores(q, w, src)  # 150 columns: two full tiles of 64 and a partial one
    assert torch.equal(got, ix.index_scores_triton(q, w, src, tile_n=64))  # the dispatch's
    want = ix.index_scores_triton(q, w, src, tile_n=128)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    k = keys.load_slots(idx.clamp(min=0).flatten()).view(*idx.shape, -1)  # [rows, cols, width]
    ref = torch.einsum("rhd,rcd->rch", q.float(), k.to(torch.bfloat16).float())
    ref = (ref.clamp(min=0) * w[:, None, :]).sum(-1)
    ref = torch.where(idx >= 0, ref, float("-inf"))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_bad_tile_setting_is_named(monkeypatch):
    try:
        for bad in ("48", "8"):
            monkeypatch.setenv("KVPLAN_INDEX_TILE_N", bad)
            with pytest.raises(
                ValueError, match=f"KVPLAN_INDEX_TILE_N must be a power of two >= 16, got {bad}"
            ):
                importlib.reload(ix)
        monkeypatch.setenv("KVPLAN_INDEX_TILE_N", "128")
        assert importlib.reload(ix).TC_TILE_N == 128
    finally:
        monkeypatch.delenv("KVPLAN_INDEX_TILE_N", raising=False)
        importlib.reload(ix)
