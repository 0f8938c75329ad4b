"""Per-token reference builders: slow, obviously-correct loops over sequences and rows.

Used by tests (field-by-field equality with the vectorized builders) and by the benchmark as
the baseline. They assume validated input and return the fields as a plain dict
``name -> numpy array | int | dict`` (per-ratio fields keyed by ``ratio_key``). Load plans
come from ``kvplan.load_plan.BlockLoadPlanBuilder``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvplan.load_plan import BlockLoadPlanBuilder
from kvplan.plan.common import compressed_kv_len
from kvplan.plan.config import QUERY_INDEX_PLACEHOLDER, MetadataConfig, ratio_key
from kvplan.plan.sequence import SequenceMetadata


def _ngram_row(s: SequenceMetadata, p: int, cfg: MetadataConfig) -> list[int]:
    row, stopped = [], False
    images = set(int(x) for x in s.image_positions)
    for g in range(cfg.max_ngram_size):
        src = p - g
        if src < 0 or src in images:
            stopped = True
        if stopped:
            row.append(cfg.pad_token_id)
        elif src < len(s.compressed_token_ids):
            row.append(int(s.compressed_token_ids[src]))
        else:
            row.append(int(s.lookup_table[s.token_at(src)]))
    return row


def _base(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> dict:
    f: dict = {k: [] for k in ("positions", "input_ids", "gate_force_random", "ngram_token_ids")}
    f.update(valid_token_mask=[], query_indices=[])
    cu_q, cu_k = [0], [0]
    for i, s in enumerate(seqs):
        q_start = s.seqlen_k - s.seqlen_q
        for j in range(s.seqlen_q):
            p = q_start + j
            f["positions"].append(p)
            if is_prompt or j == 0:
                f["input_ids"].append(int(s.token_ids[p]))
            else:
                f["input_ids"].append(int(s.draft_tokens[j - 1]))
            f["gate_force_random"].append(cfg.force_load_balance)
            f["ngram_token_ids"].append(_ngram_row(s, p, cfg))
            f["valid_token_mask"].append(not s.is_placeholder)
            f["query_indices"].append(QUERY_INDEX_PLACEHOLDER if s.is_placeholder else i)
        cu_q.append(cu_q[-1] + s.seqlen_q)
        cu_k.append(cu_k[-1] + s.seqlen_k)
    f["seqlens_q"] = [s.seqlen_q for s in seqs]
    f["seqlens_k"] = [s.seqlen_k for s in seqs]
    f["cu_seqlens_q"], f["cu_seqlens_k"] = cu_q, cu_k
    if cfg.max_ngram_size == 0:
        f["ngram_token_ids"] = None
    return f


def _swa_store(s: SequenceMetadata, j: int, cfg: MetadataConfig) -> int:
    if s.is_placeholder or s.seqlen_q - j > cfg.swa_block_size:
        return -1
    p = s.seqlen_k - s.seqlen_q + j
    return s.state_id * cfg.swa_block_size + p % cfg.swa_block_size


def _compressed_slot(s: SequenceMetadata, jc: int, tpb: int) -> int:
    return int(s.block_table[jc // tpb]) * tpb + jc % tpb


def _visible_lo(p: int, window: int, valid_start: int) -> int:
    return min(max(p - window + 1, valid_start, 0), p + 1)


def reference_prompt(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> dict:
    """Every field of ``prepare_prompt``, one row at a time."""
    f = _base(seqs, cfg, True)
    n, window, sbs = len(seqs), cfg.window_size, cfg.swa_block_size
    f["state_block_idx"] = [s.state_id for s in seqs]
    f["slot_mapping_store_swa"] = [_swa_store(s, j, cfg) for s in seqs for j in range(s.seqlen_q)]
    swa = BlockLoadPlanBuilder(sbs)
    pivots = []
    for i, s in enumerate(seqs):
        q_start = s.seqlen_k - s.seqlen_q
        hist_begin = q_start - window
        pad = min(max(s.swa_valid_start - hist_begin, 0), window)
        swa.append_zero_fill(pad)
        swa.append_ring_range(s.state_id, hist_begin + pad, q_start)
        for j in range(s.seqlen_q):
            p = q_start + j
            lo = _visible_lo(p, window, s.swa_valid_start)
            start_slot = min(lo, q_start) - (q_start - window)
            k_lo = max(0, lo - q_start)
            chunk_start = n * window + f["cu_seqlens_q"][i]
            pivots.append(
                [i * window + start_slot, window - start_slot, chunk_start + k_lo, j - k_lo + 1]
            )
    f["load_segments_swa"], f["total_k_swa"] = swa.build()
    f["kv_swa_full_index_pivots"] = pivots
    for name in ("positions_c", "slot_mapping_store_ca", "cu_compressed_seqlens_q",
                 "cu_compressed_seqlens", "load_segments_ca", "total_k_compressed", "ks", "ke",
                 "kv_ca_index_offset_len"):  # fmt: skip
        f[name] = {}
    for r in cfg.ca_ratios:
        key, tpb = ratio_key(r), cfg.tokens_per_block(r)
        plan = BlockLoadPlanBuilder(tpb)
        pos_c, slot_c, cu_rows, cu_kv, ks, ke, off_len = [], [], [0], [0], [], [], []
        for s in seqs:
            q_start = s.seqlen_k - s.seqlen_q
            if s.seqlen_k // r == 0:
                plan.append_zero_fill(1)
            else:
                plan.append_paged_range(s.block_table, 0, s.seqlen_k // r)
            new = list(range(q_start // r, s.seqlen_k // r))
            for jc in new:
                pos_c.append(0 if s.is_placeholder else jc * r)
                slot_c.append(-1 if s.is_placeholder else _compressed_slot(s, jc, tpb))
            if not new:
                pos_c.append(0)
                slot_c.append(-1)
            cu_rows.append(cu_rows[-1] + max(1, len(new)))
            for p in range(q_start, s.seqlen_k):
                ks.append(cu_kv[-1])
                ke.append(cu_kv[-1] + (p + 1) // r)
                off_len.append([cu_kv[-1], (p + 1) // r])
            cu_kv.append(cu_kv[-1] + compressed_kv_len(s.seqlen_k, r))
        f["positions_c"][key], f["slot_mapping_store_ca"][key] = pos_c, slot_c
        f["cu_compressed_seqlens_q"][key], f["cu_compressed_seqlens"][key] = cu_rows, cu_kv
        f["load_segments_ca"][key], f["total_k_compressed"][key] = plan.build()
        if r in cfg.sparse_ratios:
            f["ks"][key], f["ke"][key] = ks, ke
        if r in cfg.dense_ratios:
            f["kv_ca_index_offset_len"][key] = off_len
    return _to_numpy(f)


def reference_decode(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> dict:
    """Every field of ``prepare_decode``, one row at a time (``block_tables`` columns past a
    row's blocks are 0 here; the builders leave them unwritten)."""
    f = _base(seqs, cfg, False)
    window, sbs = cfg.window_size, cfg.swa_block_size
    total_q = len(f["positions"])
    f.update(state_block_idx=[], slot_mapping_store_swa=[], context_lens=[])
    f.update(kv_swa_index_offset_len=[], positions_c={}, slot_mapping_store_ca={}, klen={})
    f["kv_ca_index_offset_len"] = {}
    f["block_tables"] = np.zeros((total_q, cfg.max_num_blocks), dtype=np.int64)
    for r in cfg.ca_ratios:
        f["positions_c"][ratio_key(r)], f["slot_mapping_store_ca"][ratio_key(r)] = [], []
    for r in cfg.sparse_ratios:
        f["klen"][ratio_key(r)] = []
    for r in cfg.dense_ratios:
        f["kv_ca_index_offset_len"][ratio_key(r)] = []
    row = 0
    for s in seqs:
        num_blocks = cfg.num_blocks_for(s.seqlen_k)
        for j in range(s.seqlen_q):
            p = s.seqlen_k - s.seqlen_q + j
            f["state_block_idx"].append(s.state_id)
            f["slot_mapping_store_swa"].append(_swa_store(s, j, cfg))
            f["context_lens"].append(p + 1)
            lo = _visible_lo(p, window, s.swa_valid_start)
            f["kv_swa_index_offset_len"].append([s.state_id * sbs + lo % sbs, p - lo + 1])
            for c in range(num_blocks):
                f["block_tables"][row, c] = s.block_table[c]
            for r in cfg.ca_ratios:
                key = ratio_key(r)
                if (p + 1) % r == 0 and not s.is_placeholder:
                    f["positions_c"][key].append(p // r * r)
                    f["slot_mapping_store_ca"][key].append(
                        _compressed_slot(s, p // r, cfg.tokens_per_block(r))
                    )
                else:
                    f["positions_c"][key].append(0)
                    f["slot_mapping_store_ca"][key].append(-1)
            for r in cfg.sparse_ratios:
                f["klen"][ratio_key(r)].append((p + 1) // r)
            for r in cfg.dense_ratios:
                offset = row * cfg.max_num_blocks * cfg.tokens_per_block(r)
                f["kv_ca_index_offset_len"][ratio_key(r)].append([offset, (p + 1) // r])
            row += 1
    return _to_numpy(f)


def _to_numpy(f: dict) -> dict:
    out = {}
    for k, v in f.items():
        if isinstance(v, dict):
            out[k] = {kk: _arr(vv) for kk, vv in v.items()}
        else:
            out[k] = _arr(v)
    return out


def _arr(v):
    if v is None or isinstance(v, int):
        return v
    if hasattr(v, "numpy"):
        return v.numpy().astype(np.int64)
    a = np.asarray(v)
    return a if a.dtype == bool else a.astype(np.int64)
