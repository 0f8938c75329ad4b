"""The correctness oracle for the CP mirror and the YoCo views (CP sizes 1/2/4, both modes).

Each view row is expanded into its visible (source, absolute position) set through the load
plans of the full step (run into tagged buffers by ``kvplan.plan.visibility``) and the view's
own expanded indices (``kv_swa_full_index`` from its pivots, ``kv_ca_index``, ``ks``/``ke``),
then compared with DESIGN.md's rules; YoCo consumer rows add the rectangle start as one more
SWA lower bound. Every global row must appear in exactly one rank's mirror.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from plan_cases import random_config, random_prompt_batch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_prompt
from kvplan.plan.common import host_int64
from kvplan.plan.config import ratio_key
from kvplan.plan.visibility import (
    ZERO,
    apply_writes,
    expected_row,
    history_cache,
    run_compressed_load_plans,
    run_load_plan,
    source,
)


class Buffers:
    """Tagged SWA history and compressed buffers of a full-layout prompt step.

    The SWA history is loaded before the step's ring stores (which may overwrite it); the
    compressed history after the step's compressed stores (prompt.py's order).
    """

    def __init__(self, full, seqs, cfg):
        cache = history_cache(seqs, cfg)
        self.swa_hist = run_load_plan(
            full.load_segments_swa, full.total_k_swa, dict(cache.ring), cfg.swa_block_size
        )
        assert apply_writes(cache, full, cfg) == []
        self.ca = run_compressed_load_plans(full, cache, cfg)
        cu = host_int64(full.cu_seqlens_q)
        self.full_seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        self.full_pos = host_int64(full.positions)


def view_rows(view, bufs: Buffers, cfg, chunk_tags, row_global):
    """Per view row: (global row or -1, visible dict, errors)."""
    view.compute_attn_info(cfg)
    swa_buf = bufs.swa_hist + chunk_tags
    swa_idx = host_int64(view.kv_swa_full_index)
    out = []
    for t in range(len(row_global)):
        g = int(row_global[t])
        seq = int(bufs.full_seq[g]) if g >= 0 else -1
        vis, errors = {}, []

        def collect(name, tags, seq=seq, vis=vis, errors=errors, t=t):
            got = []
            for tag in tags:
                if tag == ZERO or not (isinstance(tag, tuple) and len(tag) == 2 and tag[0] == seq):
                    errors.append(f"row {t}: {name} reaches {tag}")
                else:
                    got.append(tag[1])
            if len(set(got)) != len(got):
                errors.append(f"row {t}: {name} duplicates")
            vis[name] = set(got)

        collect("swa", [swa_buf[x] for x in swa_idx[t] if x != -1])
        for r in cfg.ca_ratios:
            key = ratio_key(r)
            if r in cfg.dense_ratios:
                ids = [x for x in host_int64(view.kv_ca_index[key])[t] if x != -1]
            else:
                ids = range(int(view.ks[key][t]), int(view.ke[key][t]))
            collect(source(r), [bufs.ca[key][x] for x in ids])
        out.append((g, vis, errors))
    return out


def check_rows(rows, bufs, seqs, cfg, rect_lo=None):
    """Compare with DESIGN.md; pad rows (-1) and placeholder rows must see nothing."""
    errors = []
    for t, (g, vis, errs) in enumerate(rows):
        if g < 0 or seqs[bufs.full_seq[g]].is_placeholder:
            if g < 0 and any(vis.values()):
                errors.append(f"pad row {t} sees {vis}")
            continue
        errors += errs
        i, p = int(bufs.full_seq[g]), int(bufs.full_pos[g])
        want = expected_row(p, seqs[i].swa_valid_start, cfg)
        if rect_lo is not None:
            want["swa"] = {x for x in want["swa"] if x >= rect_lo[i]}
        for name, w in want.items():
            if vis.get(name) != w:
                got = vis.get(name, set())
                errors.append(f"row {t} (p={p}) {name}: extra {sorted(got - w)[:6]}, "
                              f"missing {sorted(w - got)[:6]}")  # fmt: skip
    assert not errors, f"{len(errors)} errors:\n" + "\n".join(errors[:10])


def full_chunk_tags(bufs):
    return [(int(i), int(p)) for i, p in zip(bufs.full_seq, bufs.full_pos)]


def run_cp(seqs, cfg, cp_size):
    """Mirror on every rank; oracle per mirror row; each global row owned exactly once."""
    full = prepare_prompt(seqs, cfg)
    bufs = Buffers(full, seqs, cfg)
    owned = []
    for rank in range(cp_size):
        view = copy.deepcopy(full).prepare_for_mirror_cp(cp_size, rank)
        idx = host_int64(view.mirror_cp_index)
        assert view.cp_mirror_len == len(idx)
        valid = idx >= 0
        assert np.array_equal(host_int64(view.positions)[valid], bufs.full_pos[idx[valid]])
        want_valid = valid & ~np.array([seqs[i].is_placeholder for i in bufs.full_seq[idx]])
        assert np.array_equal(view.valid_token_mask.cpu().numpy(), want_valid)
        check_rows(view_rows(view, bufs, cfg, full_chunk_tags(bufs), idx), bufs, seqs, cfg)
        owned += idx[valid].tolist()
    assert sorted(owned) == list(range(full.total_q))


def run_yoco(seqs, cfg, cp_size):
    """Both YoCo views against the oracle, with the CP mirror applied after the truncation."""
    from kvplan.plan.yoco import fill_yoco_truncation_metadata, get_consumer_view, get_mask_view

    full = fill_yoco_truncation_metadata(prepare_prompt(seqs, cfg), seqs, cfg)
    bufs = Buffers(full, seqs, cfg)
    rect_lo = host_int64(full.yoco_rect_lo)
    owned = []
    for rank in range(cp_size):
        meta = copy.deepcopy(full)
        if cp_size > 1:
            meta.prepare_for_mirror_cp(cp_size, rank)
        if cfg.yoco_mode == "mask":
            view = get_mask_view(meta)
            rows = host_int64(meta.mirror_cp_index) if cp_size > 1 else np.arange(full.total_q)
            tags = full_chunk_tags(bufs)
        else:
            view = get_consumer_view(meta)
            kept = host_int64(full.yoco_consumer_query_indices)
            tags = [(int(bufs.full_seq[g]), int(bufs.full_pos[g])) for g in kept]
            rows = (
                kept
                if cp_size == 1
                else np.where(
                    host_int64(view.mirror_cp_index) >= 0,
                    kept[np.maximum(host_int64(view.mirror_cp_index), 0)],
                    -1,
                )
            )
            valid = rows >= 0
            assert np.array_equal(host_int64(view.positions)[valid], bufs.full_pos[rows[valid]])
        check_rows(view_rows(view, bufs, cfg, tags, rows), bufs, seqs, cfg, rect_lo)
        owned += [int(g) for g in rows if g >= 0]
        assert full.kv_swa_full_index is None or full.kv_swa_full_index.shape[0] == full.total_q
    if cfg.yoco_mode == "mask":
        assert sorted(owned) == list(range(full.total_q))
    else:
        assert sorted(owned) == sorted(host_int64(full.yoco_consumer_query_indices).tolist())


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(8))
def test_cp_mirror_visibility(seed, cp_size):
    rng = np.random.default_rng(7000 + seed)
    cfg = random_config(rng, max_model_len=96)
    run_cp(random_prompt_batch(rng, cfg), cfg, cp_size)


@pytest.mark.parametrize("mode", ["mask", "compact"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_yoco_visibility(seed, cp_size, mode):
    rng = np.random.default_rng(8000 + seed)
    keep = int(rng.integers(1, 40))
    cfg = random_config(rng, max_model_len=96, yoco_keep_tokens=keep, yoco_mode=mode,
                        cp_size=cp_size)  # fmt: skip
    run_yoco(random_prompt_batch(rng, cfg), cfg, cp_size)


def _history_config(**kw):
    base = dict(block_size=16, dense_ratios=(2,), sparse_ratios=(4, 16), window_size=6,
                swa_block_size=8, max_model_len=128, max_num_blocks=64)  # fmt: skip
    return MetadataConfig(**{**base, **kw})


def _history_batch():
    """Chunked prefill over history, swa_valid_start > 0, ratio 16 larger than one sequence,
    a placeholder, and a chunk wholly before the YoCo rectangle."""
    table = np.arange(100, 164)
    return [
        SequenceMetadata(seqlen_q=10, seqlen_k=37, block_table=table, state_id=2,
                         token_ids=np.zeros(60), swa_valid_start=25),
        SequenceMetadata(seqlen_q=5, seqlen_k=5, block_table=[7], state_id=0,
                         token_ids=np.arange(5)),
        SequenceMetadata(seqlen_q=3, seqlen_k=3, block_table=[9], state_id=5,
                         token_ids=np.arange(3), is_placeholder=True),
        SequenceMetadata(seqlen_q=21, seqlen_k=50, block_table=table[10:], state_id=4,
                         token_ids=np.arange(52), swa_valid_start=12),
    ]  # fmt: skip


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_chunked_history_cp(cp_size):
    cfg = _history_config(cp_size=cp_size)
    run_cp(_history_batch(), cfg, cp_size)


@pytest.mark.parametrize("mode", ["mask", "compact"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_chunked_history_yoco(cp_size, mode):
    cfg = _history_config(cp_size=cp_size, yoco_keep_tokens=8, yoco_mode=mode)
    run_yoco(_history_batch(), cfg, cp_size)


def test_pure_dense_model_drops_the_dummy_ratio():
    cfg = _history_config(sparse_ratios=())
    full = prepare_prompt(_history_batch(), cfg)
    view = copy.deepcopy(full).prepare_for_mirror_cp(2, 1)
    assert view.ks == {} and view.ke == {}
    run_cp(_history_batch(), cfg, 2)


def test_oracle_catches_a_wrong_mirror_row():
    cfg = _history_config()
    seqs = _history_batch()
    full = prepare_prompt(seqs, cfg)
    bufs = Buffers(full, seqs, cfg)
    view = copy.deepcopy(full).prepare_for_mirror_cp(2, 0)
    idx = host_int64(view.mirror_cp_index)
    view.kv_swa_full_index_pivots = torch.roll(view.kv_swa_full_index_pivots, 1, 0)
    with pytest.raises(AssertionError, match="errors"):
        check_rows(view_rows(view, bufs, cfg, full_chunk_tags(bufs), idx), bufs, seqs, cfg)


def test_seed_worked_example_cp_and_yoco():
    """seqlen_k 10000, seqlen_q 1024, block 64, ratio 4, window 4096 (sampled mirror rows)."""
    cfg = MetadataConfig(block_size=64, dense_ratios=(4,), sparse_ratios=(4,), window_size=4096,
                         swa_block_size=4096, max_model_len=16384, max_num_blocks=256,
                         cp_size=2, yoco_keep_tokens=300, yoco_mode="compact")  # fmt: skip
    s = SequenceMetadata(seqlen_q=1024, seqlen_k=10000, block_table=np.arange(1000, 1157),
                         state_id=3, token_ids=np.zeros(10000))  # fmt: skip
    from kvplan.plan.yoco import fill_yoco_truncation_metadata, get_consumer_view

    full = fill_yoco_truncation_metadata(prepare_prompt([s], cfg), [s], cfg)
    assert int(full.yoco_rect_lo[0]) == 9700 and int(full.yoco_clip_prefix[0]) == 9700 - 8976
    bufs = Buffers(full, [s], cfg)
    view = copy.deepcopy(full).prepare_for_mirror_cp(2, 1)
    assert view.cp_mirror_len == 512  # 2 * ceil(1024 / 4)
    idx = host_int64(view.mirror_cp_index)
    assert idx[:3].tolist() == [256, 257, 258] and idx[256:259].tolist() == [512, 513, 514]
    sample = [0, 255, 256, 511]
    small = copy.copy(view)
    small.kv_swa_full_index_pivots = view.kv_swa_full_index_pivots[sample]
    small.kv_ca_index_offset_len = {k: v[sample] for k, v in view.kv_ca_index_offset_len.items()}
    small.ks = {k: v[sample] for k, v in view.ks.items()}
    small.ke = {k: v[sample] for k, v in view.ke.items()}
    small.clean()
    check_rows(view_rows(small, bufs, cfg, full_chunk_tags(bufs), idx[sample]), bufs, [s], cfg)
    consumer = get_consumer_view(view)
    assert consumer.total_q == 300 and consumer.cp_mirror_len == 2 * 75
    # clip 724, pieces of 256: rank 0 keeps all of piece 3, rank 1 keeps 768 - 724 = 44
    assert full.yoco_consumer_cp_contrib_pad_len == 256
