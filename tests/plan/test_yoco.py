"""YoCo truncation: rectangle, clip_prefix, compact fields against a per-token reference,
the two views (shallow copies) and the CP redistribution indices."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from plan_cases import random_config, random_prompt_batch

from kvplan.plan import prepare_prompt
from kvplan.plan.cp_mirror import prepare_cp_mirror
from kvplan.plan.yoco import (
    fill_yoco_truncation_metadata,
    get_consumer_view,
    get_mask_view,
    yoco_rectangle,
)


def _cfg(rng, mode, cp_size=1):
    return random_config(rng, max_model_len=96, yoco_keep_tokens=int(rng.integers(1, 40)),
                         yoco_mode=mode, cp_size=cp_size)  # fmt: skip


def test_rectangle_matches_the_seed_formula():
    rng = np.random.default_rng(0)
    sk = rng.integers(1, 200, 500)
    sq = np.minimum(rng.integers(1, 200, 500), sk)
    data_len = sk + rng.integers(0, 50, 500)
    keep = 30
    rect_lo, clip = yoco_rectangle(sq, sk, data_len, keep, compact=True)
    for i in range(500):
        q_start = sk[i] - sq[i]
        assert rect_lo[i] == max(0, data_len[i] - keep)
        assert clip[i] == min(max(data_len[i] - keep - q_start, 0), sq[i] - 1)
    assert np.all(sq - clip >= 1)
    assert np.all(yoco_rectangle(sq, sk, data_len, keep, compact=False)[1] == 0)


@pytest.mark.parametrize("seed", range(6))
def test_compact_fields_match_per_token_reference(seed):
    rng = np.random.default_rng(100 + seed)
    cfg = _cfg(rng, "compact")
    seqs = random_prompt_batch(rng, cfg)
    meta = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
    keep = cfg.yoco_keep_tokens
    rows, pos, slots, cu = [], [], [], [0]
    ke = {r: [] for r in cfg.sparse_ratios}
    base = dict.fromkeys(cfg.sparse_ratios, 0)
    g = 0
    for s in seqs:
        q_start, rect_lo = s.seqlen_k - s.seqlen_q, max(0, len(s.token_ids) - keep)
        clip = min(max(rect_lo - q_start, 0), s.seqlen_q - 1)
        for j in range(clip, s.seqlen_q):
            p = q_start + j
            rows.append(g + j)
            pos.append(p)
            stores = p >= rect_lo and s.seqlen_q - j <= cfg.swa_block_size and not s.is_placeholder
            slots.append(s.state_id * cfg.swa_block_size + p % cfg.swa_block_size if stores else -1)
            for r in cfg.sparse_ratios:
                ke[r].append(base[r] + (p + 1) // r)
        g += s.seqlen_q
        cu.append(cu[-1] + s.seqlen_q - clip)
        for r in cfg.sparse_ratios:
            base[r] += max(1, s.seqlen_k // r)
    assert meta.yoco_consumer_query_indices.tolist() == rows
    assert meta.yoco_consumer_positions.tolist() == pos
    assert meta.yoco_consumer_slot_mapping_store_swa.tolist() == slots
    assert meta.yoco_consumer_cu_seqlens_q.tolist() == cu
    assert meta.yoco_consumer_total_q == cu[-1]
    for r in cfg.sparse_ratios:
        assert meta.yoco_consumer_ke[str(r)].tolist() == ke[r]


def test_views_are_shallow_copies_and_leave_meta_alone():
    rng = np.random.default_rng(3)
    for mode in ("mask", "compact"):
        cfg = _cfg(rng, mode)
        seqs = random_prompt_batch(rng, cfg, n=3)
        meta = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
        meta.compute_attn_info(cfg)
        before = copy.deepcopy(meta)
        view = get_mask_view(meta) if mode == "mask" else get_consumer_view(meta)
        assert view.kv_swa_full_index is None and view.kv_ca_index == {}
        assert view.input_ids is meta.input_ids  # shared, not copied
        view.compute_attn_info(cfg)
        for name in ("kv_swa_full_index_pivots", "positions", "kv_swa_full_index"):
            assert torch.equal(getattr(meta, name), getattr(before, name)), name
        for k in meta.kv_ca_index:
            assert torch.equal(meta.kv_ca_index[k], before.kv_ca_index[k])
        if mode == "mask":
            assert torch.equal(view.kv_swa_full_index_pivots, meta.yoco_mask_swa_index_pivots)
            assert view.total_q == meta.total_q
        else:
            assert view.total_q == meta.yoco_consumer_total_q == view.positions.shape[0]
            assert view.kv_swa_full_index.shape[0] == view.total_q


def test_view_needs_its_fill():
    rng = np.random.default_rng(4)
    cfg = _cfg(rng, "mask")
    seqs = random_prompt_batch(rng, cfg)
    meta = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
    with pytest.raises(ValueError, match="compact"):
        get_consumer_view(meta)
    plain = prepare_prompt(seqs, random_config(np.random.default_rng(4), max_model_len=96))
    with pytest.raises(ValueError, match="yoco_mode"):
        fill_yoco_truncation_metadata(plain, seqs, random_config(rng, max_model_len=96))
    mirrored = copy.deepcopy(meta).prepare_for_mirror_cp(2, 0)
    with pytest.raises(ValueError, match="before CP"):
        fill_yoco_truncation_metadata(mirrored, seqs, cfg)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_cp_redistribution_moves_kept_rows(seed, cp_size):
    """Full-mirror hidden rows -> contribution -> all-gather -> compact-mirror rows."""
    rng = np.random.default_rng(200 + seed)
    cfg = _cfg(rng, "compact", cp_size)
    seqs = random_prompt_batch(rng, cfg)
    full = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
    pad = full.yoco_consumer_cp_contrib_pad_len
    views, sent = [], []
    for rank in range(cp_size):
        view = get_consumer_view(copy.deepcopy(full).prepare_for_mirror_cp(cp_size, rank))
        hidden = prepare_cp_mirror(full.cu_seqlens_q, full.cu_seqlens_k, cp_size, rank, ())
        hidden = hidden.mirror_cp_index  # the global row each full-mirror row computed
        c = view.yoco_cp_contrib_index.long()
        assert c.shape == (pad,)
        sent.append(torch.where(c >= 0, hidden[c.clamp(min=0)], -1))
        views.append(view)
    gathered = torch.cat(sent)  # [cp_size * pad]
    kept = full.yoco_consumer_query_indices
    for view in views:
        b = view.yoco_cp_boundary_index.long()
        m = view.mirror_cp_index.long()
        want = torch.where(m >= 0, kept[m.clamp(min=0)], -1)
        got = torch.where(b >= 0, gathered[b.clamp(min=0)], -1)
        assert torch.equal(got, want)
        assert view.cp_mirror_len == full.yoco_consumer_cp_mirror_len
    per_rank = [int((s >= 0).sum()) for s in sent]
    assert max(per_rank) == pad and sum(per_rank) == full.yoco_consumer_total_q


def test_views_fill_on_demand():
    rng = np.random.default_rng(9)
    cfg = _cfg(rng, "compact")
    seqs = random_prompt_batch(rng, cfg)
    meta = prepare_prompt(seqs, cfg)
    view = meta.get_consumer_view(seqs, cfg)
    assert view.total_q == meta.yoco_consumer_total_q
    with pytest.raises(ValueError, match="needs 'mask'"):
        get_mask_view(prepare_prompt(seqs, cfg), seqs, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_gpu_views_and_mirror_equal_cpu(mode):
    """CP mirror + YoCo views of CUDA metadata equal those of CPU metadata (CPU counterpart:
    every other test in this file and test_visibility_cp_yoco.py)."""
    import dataclasses

    rng = np.random.default_rng(11)
    cfg = _cfg(rng, mode, cp_size=2)
    seqs = random_prompt_batch(rng, cfg, n=4)
    metas = []
    for c in (cfg, dataclasses.replace(cfg, device="cuda")):
        meta = fill_yoco_truncation_metadata(prepare_prompt(seqs, c), seqs, c)
        meta.prepare_for_mirror_cp(2, 1)
        view = get_mask_view(meta) if mode == "mask" else get_consumer_view(meta)
        metas.append(view.compute_attn_info(c))
    cpu, gpu = metas
    for name in ("positions", "valid_token_mask", "kv_swa_full_index", "mirror_cp_index"):
        assert getattr(gpu, name).is_cuda, name
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    for k in cpu.ks:
        assert torch.equal(gpu.ks[k].cpu(), cpu.ks[k]) and torch.equal(gpu.ke[k].cpu(), cpu.ke[k])
    for k in cpu.kv_ca_index:
        assert torch.equal(gpu.kv_ca_index[k].cpu(), cpu.kv_ca_index[k]), k


def test_yoco_and_mirror_fields_survive_flatten():
    """The yoco_* / mirror fields are plain attributes: to_flatten_dict / from_flatten_dict
    (what broadcast sends) carry them, and the views rebuilt on the far side are equal."""
    from kvplan.plan import InputMetadata

    rng = np.random.default_rng(12)
    cfg = _cfg(rng, "compact", cp_size=2)
    seqs = random_prompt_batch(rng, cfg)
    meta = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
    meta.prepare_for_mirror_cp(2, 1)
    back = InputMetadata.from_flatten_dict(meta.to_flatten_dict())
    a, b = get_consumer_view(meta), get_consumer_view(back)
    for name in ("positions", "mirror_cp_index", "yoco_cp_boundary_index", "yoco_cp_contrib_index",
                 "kv_swa_full_index_pivots", "slot_mapping_store_swa"):  # fmt: skip
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.ks.keys() == b.ks.keys() and all(torch.equal(a.ks[k], b.ks[k]) for k in a.ks)
