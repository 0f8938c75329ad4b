"""Sparse hooks: None for dense, one predicate for both sides, the vanilla sparse path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import (
    assert_close,
    fill_metadata,
    make_scenario,
    random_specs,
    reference_attention,
)

from kvplan.backends import (
    AttentionMetadata,
    SparseMetadataParams,
    SparseRuntimeParams,
    get_backend,
    use_sparse_attention,
)


def test_dense_defaults_and_predicate():
    md = AttentionMetadata(max_num_requests=2, max_num_tokens=8)
    assert md.sparse_metadata_params is None and md.sparse_runtime_params.is_empty
    assert not use_sparse_attention(None, 0) and not use_sparse_attention(None)
    p = SparseMetadataParams(layers=[1, 3])
    assert [use_sparse_attention(p, i) for i in range(4)] == [False, True, False, True]
    assert use_sparse_attention(p) and use_sparse_attention(SparseMetadataParams(), 7)
    assert not use_sparse_attention(SparseMetadataParams(layers=[]))
    with pytest.raises(ValueError, match="granularity"):
        SparseMetadataParams(granularity="token")
    assert SparseRuntimeParams(sparse_kv_indices=torch.zeros(1)).is_empty is False


def _selection(sc, seed):
    """Random kept blocks per row, always keeping the blocks of the row's own queries."""
    rng = np.random.default_rng(seed)
    bs = sc.manager.block_size
    selected, flat, offsets = [], [], [0]
    for row, q_len in enumerate(sc.seq_lens):
        kv_len = sc.history[0][row][0].shape[0]
        nb = -(-kv_len // bs)
        own = set(range((kv_len - q_len) // bs, nb))
        keep = sorted(own | {int(b) for b in np.flatnonzero(rng.random(nb) < 0.4)})
        selected.append(set(keep))
        flat.extend(keep)
        offsets.append(len(flat))
    return selected, torch.tensor(flat, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32)


def test_vanilla_sparse_layer_matches_restricted_reference():
    sc = make_scenario(
        13, random_specs(13, num_ctx=2, num_gen=4, max_cached=60), layer_windows=(None, None)
    )
    selected, flat, offsets = _selection(sc, 13)
    cls = get_backend("vanilla")
    md = cls.Metadata(
        max_num_requests=8, max_num_tokens=128, kv_cache_manager=sc.manager, kv_cache=sc.kv,
        sparse_metadata_params=SparseMetadataParams(layers=[1]),
    )  # fmt: skip
    md.sparse_runtime_params = SparseRuntimeParams(
        sparse_kv_indices=flat, sparse_kv_offsets=offsets
    )
    fill_metadata(md, sc)
    md.prepare()
    dense = cls(0, 4, 2, 16).forward(sc.q, sc.k[0], sc.v[0], md)
    sparse = cls(1, 4, 2, 16).forward(sc.q, sc.k[1], sc.v[1], md)
    assert_close(dense, reference_attention(sc, 0, None), atol=1e-5)
    want = reference_attention(sc, 1, None, selected_blocks=selected)
    assert_close(sparse, want, atol=1e-5)
    assert not torch.allclose(sparse.double(), reference_attention(sc, 1, None), atol=1e-3)
    # the paged backends have no sparse path: the shared predicate makes them refuse
    for name in ("ragged", "block_offsets"):
        pcls = get_backend(name)
        pmd = pcls.Metadata(
            max_num_requests=8, max_num_tokens=128, kv_cache_manager=sc.manager, kv_cache=sc.kv,
            sparse_metadata_params=SparseMetadataParams(layers=[1]),
        )  # fmt: skip
        fill_metadata(pmd, sc)
        pmd.prepare()
        with pytest.raises(NotImplementedError, match="sparse"):
            pcls(1, 4, 2, 16).forward(sc.q, sc.k[1], sc.v[1], pmd)
    md.sparse_runtime_params = SparseRuntimeParams()
    with pytest.raises(ValueError, match="sparse_kv_indices"):
        md.prepare()
    md.sparse_runtime_params = SparseRuntimeParams(
        sparse_kv_indices=torch.tensor([99], dtype=torch.int32),
        sparse_kv_offsets=torch.tensor([0, 1] + [1] * (md.num_seqs - 1), dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="outside"):
        md.prepare()
