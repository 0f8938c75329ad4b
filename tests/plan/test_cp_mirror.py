"""CP mirror: zigzag rows, reverse index and per-row ks/ke against a per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplan.plan.cp_mirror import cp_mirror_len, prepare_cp_mirror


def _mirror_ref(seqlen_q, seqlen_k, cp_size, rank, ratios):
    """Per-token loop: mirror rows of ``rank`` with their key ranges."""
    rows, ks, ke = [], {r: [] for r in ratios}, {r: [] for r in ratios}
    cu = 0
    base = dict.fromkeys(ratios, 0)
    for sq, sk in zip(seqlen_q, seqlen_k):
        ps = -(-sq // (2 * cp_size))
        for piece in (rank, 2 * cp_size - 1 - rank):
            for t in range(ps):
                j = piece * ps + t
                rows.append(cu + j if j < sq else -1)
                for r in ratios:
                    ks[r].append(base[r] if j < sq else 0)
                    ke[r].append(base[r] + (sk - sq + j + 1) // r if j < sq else 0)
        cu += sq
        for r in ratios:
            base[r] += max(1, sk // r)
    return rows, ks, ke


def _random_batch(rng, n_seq, max_q=40):
    seqlen_q = rng.integers(1, max_q, n_seq)
    seqlen_k = seqlen_q + rng.integers(0, 100, n_seq)
    cu_q = np.concatenate([[0], np.cumsum(seqlen_q)])
    cu_k = np.concatenate([[0], np.cumsum(seqlen_k)])
    return seqlen_q, seqlen_k, cu_q, cu_k


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prepare_cp_mirror_matches_reference(cp_size, seed):
    rng = np.random.default_rng(seed)
    sq, sk, cu_q, cu_k = _random_batch(rng, int(rng.integers(1, 7)))
    ratios = (4, 16, 128)
    total_q = int(cu_q[-1])
    mirrors = []
    for rank in range(cp_size):
        got = prepare_cp_mirror(torch.tensor(cu_q), torch.tensor(cu_k), cp_size, rank, ratios)
        rows, ks, ke = _mirror_ref(sq.tolist(), sk.tolist(), cp_size, rank, ratios)
        assert got.cp_mirror_len == len(rows) == cp_mirror_len(sq, cp_size)
        assert got.mirror_cp_index.dtype == torch.int32
        assert got.mirror_cp_index.tolist() == rows
        for r in ratios:
            assert got.ks[str(r)].tolist() == ks[r]
            assert got.ke[str(r)].tolist() == ke[r]
        mirrors.append(got)
    # every global row is owned by exactly one (rank, mirror row) and reverse points at it
    gathered = torch.cat([m.mirror_cp_index for m in mirrors])  # [cp_size * mlen]
    valid = gathered[gathered >= 0]
    assert sorted(valid.tolist()) == list(range(total_q))
    for m in mirrors:
        assert torch.equal(gathered[m.mirror_cp_reverse_index.long()], torch.arange(total_q).int())


def test_zigzag_example_from_docstring():
    got = [
        prepare_cp_mirror([0, 10], [0, 10], 2, rank, ()).mirror_cp_index.tolist() for rank in (0, 1)
    ]
    assert got == [[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]]


def test_compact_rows_keep_their_absolute_positions():
    # The last 3 rows of a 10-row chunk at q_start 90 (seqlen_k 100): ke uses positions 97..99.
    got = prepare_cp_mirror([0, 3], [0, 100], 1, 0, (4,))
    assert got.ke["4"].tolist() == [98 // 4, 99 // 4, 100 // 4, 0]  # ps = 2: one pad row


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_size": 0, "cp_rank": 0}, "cp_size"),
        ({"cp_size": 2, "cp_rank": 2}, "cp_rank"),
    ],
)
def test_bad_group(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_cp_mirror([0, 4], [0, 4], ratios=(), **kwargs)


def test_bad_lengths():
    with pytest.raises(ValueError, match="seqlen_q"):
        prepare_cp_mirror([0, 5], [0, 4], 1, 0, ())
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prepare_cp_mirror([1, 5], [0, 5], 1, 0, ())


# ---- prepare_for_mirror_cp on prompt metadata ----------------------------------------------


def _prompt(seed, **kw):
    import copy

    from plan_cases import random_config, random_prompt_batch

    from kvplan.plan import prepare_prompt

    rng = np.random.default_rng(seed)
    cfg = random_config(rng, max_model_len=96, **kw)
    seqs = random_prompt_batch(rng, cfg)
    meta = prepare_prompt(seqs, cfg)
    return cfg, seqs, meta, copy.deepcopy(meta)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_prepare_for_mirror_cp_fields(seed, cp_size):
    cfg, seqs, full, meta = _prompt(300 + seed)
    rank = seed % cp_size
    out = meta.prepare_for_mirror_cp(cp_size, rank)
    assert out is meta
    idx = meta.mirror_cp_index.long()
    valid = idx >= 0
    g = idx.clamp(min=0)
    # query-aligned fields move with their rows; originals kept where the design says so
    assert torch.equal(meta.positions_cp, full.positions)
    assert torch.equal(meta.positions[valid], full.positions[g][valid])
    assert torch.equal(meta.query_indices[valid], full.query_indices[g][valid])
    assert bool((meta.query_indices[~valid] == 998244353).all())
    assert torch.equal(meta.valid_token_mask, valid & full.valid_token_mask[g])
    assert torch.equal(meta.gate_force_random, full.gate_force_random)
    assert torch.equal(meta.gate_force_random_cp[valid], full.gate_force_random[g][valid])
    assert torch.equal(
        meta.kv_swa_full_index_pivots[valid], full.kv_swa_full_index_pivots[g][valid]
    )
    for k, v in full.kv_ca_index_offset_len.items():
        assert torch.equal(meta.kv_ca_index_offset_len[k][valid], v[g][valid])
        assert bool((meta.kv_ca_index_offset_len[k][~valid][:, 1] == 0).all())
    for k in full.ks:  # ks/ke recomputed from cu_seqlens equal the gathered full ones
        assert torch.equal(meta.ks[k][valid], full.ks[k][g][valid])
        assert torch.equal(meta.ke[k][valid], full.ke[k][g][valid])
    if full.ngram_token_ids is not None:
        assert torch.equal(meta.ngram_token_ids[valid], full.ngram_token_ids[g][valid])
    for name in ("input_ids", "cu_seqlens_q", "cu_seqlens_k", "slot_mapping_store_swa",
                 "load_segments_swa"):  # fmt: skip
        assert torch.equal(getattr(meta, name), getattr(full, name)), name
    assert meta.total_q == full.total_q and meta.cp_mirror_len == len(idx)
    assert meta.kv_swa_full_index is None and meta.kv_ca_index == {}
    assert (meta.cp_size, meta.cp_rank) == (cp_size, rank)


def test_image_mask_keeps_the_full_copy():
    _, _, full, meta = _prompt(1)
    mask = torch.arange(full.total_q) % 3 == 0
    meta.images_seq_mask = mask
    meta.prepare_for_mirror_cp(2, 1)
    idx = meta.mirror_cp_index.long()
    assert meta.images_seq_mask_full is mask
    assert torch.equal(meta.images_seq_mask, torch.where(idx >= 0, mask[idx.clamp(min=0)], False))


def test_mirror_cp_refuses_decode_and_double_mirror():
    _, _, _, meta = _prompt(2)
    meta.prepare_for_mirror_cp(2, 0)
    with pytest.raises(ValueError, match="already"):
        meta.prepare_for_mirror_cp(2, 1)
    meta.is_prompt = False
    with pytest.raises(ValueError, match="prompt"):
        meta.prepare_for_mirror_cp(2, 1)
