"""The common base of every builder: positions, ids, masks, cu_seqlens and Engram n-grams.

Vectorized numpy over all query rows; ``reference.py`` holds the per-token loops they equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplan._math import exclusive_cumsum
from kvplan.plan.batch import BatchArrays, Emitter
from kvplan.plan.config import QUERY_INDEX_PLACEHOLDER, MetadataConfig
from kvplan.plan.sequence import SequenceMetadata


def gather_input_ids(seqs: Sequence[SequenceMetadata], is_prompt: bool) -> np.ndarray:
    """``input_ids`` [T] int64: prompt: ``token_ids[q_start:seqlen_k]``; decode: the last
    confirmed token ``token_ids[q_start]`` followed by the draft tokens."""
    if is_prompt:
        parts = [s.token_ids[s.seqlen_k - s.seqlen_q : s.seqlen_k] for s in seqs]
        return np.concatenate(parts).astype(np.int64, copy=False)
    ids: list[int] = []
    for s in seqs:
        ids.append(s.token_ids[-1])
        ids.extend(s.draft_tokens)
    return np.array(ids, dtype=np.int64)


def _known_ids(s: SequenceMetadata, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Engram ids and image flags of raw positions ``[lo, hi)`` of one sequence."""
    comp = s.compressed_token_ids
    n_comp = len(comp)
    ids = np.empty(hi - lo, dtype=np.int64)
    mid = min(max(n_comp, lo), hi)
    ids[: mid - lo] = np.asarray(comp[lo:mid], dtype=np.int64)
    if mid < hi:
        if s.lookup_table is None:
            raise ValueError(
                f"lookup_table is None but positions {mid}..{hi - 1} are past the "
                f"{n_comp} compressed_token_ids"
            )
        n_tok = len(s.token_ids)
        raw = np.empty(hi - mid, dtype=np.int64)
        a = min(max(n_tok, mid), hi)
        raw[: a - mid] = np.asarray(s.token_ids[mid:a], dtype=np.int64)
        raw[a - mid :] = np.asarray(s.draft_tokens[a - n_tok : hi - n_tok], dtype=np.int64)
        table = np.asarray(s.lookup_table)
        if raw.size and (raw.min() < 0 or raw.max() >= len(table)):
            raise ValueError(f"token id outside lookup_table of {len(table)} entries")
        ids[mid - lo :] = table[raw]
    img = np.zeros(hi - lo, dtype=bool)
    if len(s.image_positions):
        ip = np.asarray(s.image_positions, dtype=np.int64)
        ip = ip[(ip >= lo) & (ip < hi)]
        img[ip - lo] = True
    return ids, img


def ngram_token_ids(
    seqs: Sequence[SequenceMetadata], b: BatchArrays, cfg: MetadataConfig
) -> np.ndarray:
    """``ngram_token_ids`` [T, G]: column ``g`` of the row at ``p`` is the Engram id of
    position ``p - g``: ``compressed_token_ids[s]`` when known, else the lookup of the raw
    token (confirmed or draft); ``pad_token_id`` when ``s < 0`` or when an image token lies in
    ``[s, p]`` (the window stops at the image token, the image token itself included)."""
    g_max = cfg.max_ngram_size
    lo = np.maximum(b.q_start - g_max + 1, 0)  # first position any row of the seq looks at
    ids_parts, img_parts = [], []
    for i, s in enumerate(seqs):
        ids, img = _known_ids(s, int(lo[i]), int(b.seqlen_k[i]))
        ids_parts.append(ids)
        img_parts.append(img)
    ids = np.concatenate(ids_parts)
    img = np.concatenate(img_parts)
    base = exclusive_cumsum(b.seqlen_k - lo)
    # last image index at or before each flat entry (-1: none yet)
    last_img = np.maximum.accumulate(np.where(img, np.arange(len(img)), -1))
    row_base = base[:-1][b.row_seq]
    row_lo = lo[b.row_seq]
    here = row_base + b.row_pos - row_lo  # flat index of the row's own position
    li = last_img[here]
    img_pos = np.where(li >= row_base, li - row_base + row_lo, -1)  # -1: no image
    g = np.arange(g_max, dtype=np.int64)
    src = b.row_pos[:, None] - g[None, :]  # [T, G]
    pad = (src < 0) | (src <= img_pos[:, None])
    flat = np.where(pad, 0, row_base[:, None] + src - row_lo[:, None])
    return np.where(pad, cfg.pad_token_id, ids[flat])


def add_base_fields(
    em: Emitter,
    meta,
    seqs: Sequence[SequenceMetadata],
    b: BatchArrays,
    cfg: MetadataConfig,
    *,
    is_prompt: bool,
) -> None:
    """Positions, input_ids, gate_force_random, ngram_token_ids, valid_token_mask,
    query_indices, seqlens and cu_seqlens (identical rules for prompt and decode)."""
    n, total_q = b.num_seqs, b.total_q
    meta.is_prompt = is_prompt
    meta.num_seqs = n
    meta.total_q = total_q
    meta.max_seqlen_q = int(b.seqlen_q.max())
    meta.max_seqlen_k = int(b.seqlen_k.max())
    i32 = torch.int32
    em.add("positions", b.row_pos, i32)
    em.add("input_ids", gather_input_ids(seqs, is_prompt), i32)
    em.add("gate_force_random", np.full(total_q, cfg.force_load_balance), torch.bool)
    if cfg.max_ngram_size > 0:
        em.add("ngram_token_ids", ngram_token_ids(seqs, b, cfg), i32)
    row_ph = b.is_placeholder[b.row_seq]
    em.add("valid_token_mask", ~row_ph, torch.bool)
    em.add("query_indices", np.where(row_ph, QUERY_INDEX_PLACEHOLDER, b.row_seq), i32)
    em.add("seqlens_q", b.seqlen_q, i32)
    em.add("seqlens_k", b.seqlen_k, i32)
    em.add("cu_seqlens_q", b.cu_q, i32)
    em.add("cu_seqlens_k", b.cu_k, i32)
