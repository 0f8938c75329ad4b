"""``prepare_prompt``: chunked-prefill metadata, vectorized over rows and segments (numpy).

A prompt chunk of a sequence covers positions ``[q_start, seqlen_k)``. Its attention reads:

* SWA: one concatenated buffer ``[n * W history rows | T chunk rows]``. ``load_segments_swa``
  fills sequence ``i``'s ``W`` history rows (positions ``[q_start - W, q_start)``) from its ring:
  zeros for positions below ``max(swa_valid_start, 0)``, then at most two ring pieces::

      dst rows   i*W                                     (i+1)*W
                 | zero fill (pad) | ring [b % sbs, ..) | ring [0, ..) |
      positions  q_start-W         valid_begin                q_start

  The chunk's own KV is copied to rows ``n * W + cu_seqlens_q[i] + k`` by the caller.
  ``kv_swa_full_index_pivots`` give each row its two ranges (``common.swa_pivots``). The load
  happens before this step's SWA store (the store may overwrite ring slots that are read).
* Compressed (ratio ``r``): ``load_segments_ca[r]`` fills sequence ``i``'s compressed tokens
  ``0 .. seqlen_k // r - 1`` at rows ``cu_compressed_seqlens[r][i] ..`` (one zero row when there
  is none, ``compressed_kv_len``); this step's compressed tokens must be stored before it.
  Sparse ratios: the row at ``p`` may pick among buffer rows ``[ks, ke)`` with
  ``ke - ks = (p + 1) // r``; dense ratios: ``kv_ca_index_offset_len = (ks, (p + 1) // r)``.

Worked example: ``seqlen_k = 10000, seqlen_q = 1024, block_size = 64, r = 4,
W = swa_block_size = 4096``: 157 compressed segments (156 x 16 + 4 tokens),
``total_k_compressed = 2500``; SWA ring ``[4880, 8976)`` -> ``[sid, 784, 4096, 0]`` and
``[sid, 0, 784, 3312]``; ``total_k_swa = 4096``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan._math import cdiv, exclusive_cumsum
from kvplan.plan.base_fields import add_base_fields
from kvplan.plan.batch import BatchArrays, Emitter, extract_batch
from kvplan.plan.common import (
    compressed_kv_len,
    num_complete_groups,
    num_new_compressed,
    paged_slot,
    ring_slot,
    swa_pivots_rel,
    swa_stores,
)
from kvplan.plan.config import MetadataConfig, ratio_key
from kvplan.plan.metadata import InputMetadata
from kvplan.plan.sequence import SequenceMetadata

I32 = torch.int32


def compressed_load_segments(b: BatchArrays, ratio: int, tpb: int, cu_ckv: np.ndarray):
    """``load_segments_ca[r]`` int32 [S, 4]: one segment per block of compressed tokens
    ``0 .. seqlen_k // r``, or one zero row ``[-1, 0, 1, dst]`` for a sequence with no complete
    group. Equals ``BlockLoadPlanBuilder(tpb)`` fed ``append_paged_range`` /
    ``append_zero_fill(1)`` (tests hold them equal)."""
    nt = num_complete_groups(b.seqlen_k, ratio)  # [n]
    nseg = np.maximum(cdiv(nt, tpb), 1)
    cu_seg = exclusive_cumsum(nseg)
    total = int(cu_seg[-1])
    idx = np.arange(total, dtype=np.int32)
    seg = np.empty((total, 4), dtype=np.int32)
    zero = nt == 0
    # block ids: each sequence reads a prefix of its own table, contiguous in bt_flat
    src_shift = np.where(zero, 0, b.bt_off[:-1]) - cu_seg[:-1]  # zero rows read entry 0
    if len(b.bt_flat):
        seg[:, 0] = b.bt_flat[idx + np.repeat(src_shift.astype(np.int32), nseg)]
    seg[:, 1] = 0
    seg[:, 2] = tpb
    seg[:, 3] = idx * tpb + np.repeat((cu_ckv[:-1] - cu_seg[:-1] * tpb).astype(np.int32), nseg)
    last = cu_seg[1:] - 1  # each sequence's last segment: the partial block
    seg[last, 2] = np.where(zero, 1, nt - (nseg - 1) * tpb)
    seg[last[zero], 0] = -1
    return seg


def swa_load_segments(b: BatchArrays, window: int, sbs: int) -> np.ndarray:
    """``load_segments_swa`` [S, 4]: per sequence a zero fill, then at most two ring pieces
    (``BlockLoadPlanBuilder(sbs)`` fed ``append_zero_fill`` / ``append_ring_range``)."""
    hist_begin = b.q_start - window
    pad = np.clip(b.valid_start - hist_begin, 0, window)
    valid_begin = hist_begin + pad
    length = b.q_start - valid_begin
    start = valid_begin % sbs
    first = np.minimum(length, sbs - start)
    n = b.num_seqs
    block = np.stack([np.full(n, -1), b.state_id, b.state_id], 1)  # [n, 3]
    begin = np.stack([np.zeros(n, np.int64), start, np.zeros(n, np.int64)], 1)
    lens = np.stack([pad, first, length - first], 1)
    dst = np.arange(n, dtype=np.int64)[:, None] * window + np.cumsum(lens, 1) - lens
    keep = (lens > 0).reshape(-1)
    return np.stack(
        [a.reshape(-1)[keep] for a in (block, begin, begin + lens, dst)], axis=1
    ).reshape(-1, 4)


def _rep(per_seq: np.ndarray, b: BatchArrays) -> np.ndarray:
    """Per-sequence values repeated over each sequence's rows (int32 [T])."""
    return np.repeat(per_seq.astype(np.int32), b.seqlen_q)


def add_prompt_fields(em: Emitter, b: BatchArrays, cfg: MetadataConfig, meta) -> None:
    """Every prompt-specific field (see the module docstring). Row arrays are int32; the
    per-sequence parts are computed on ``[n]`` arrays and repeated over the rows."""
    n, pos, j, total_q = b.num_seqs, b.row_pos, b.row_j, b.total_q
    sbs, window = cfg.swa_block_size, cfg.window_size
    check_int32("total_k_swa + total_q", n * window + total_q)
    ph = b.is_placeholder

    em.add("state_block_idx", b.state_id, I32)
    # the chunk's last sbs rows store into the ring; a placeholder counts as sbs rows longer
    # than it is, so none of its rows does
    stores = swa_stores(_rep(np.where(ph, b.seqlen_q + sbs, b.seqlen_q), b), j, sbs)
    slot = ring_slot(_rep(b.state_id, b), pos, sbs)
    slot[~stores] = -1
    em.add("slot_mapping_store_swa", slot, I32)
    meta.total_k_swa = n * window
    em.add("load_segments_swa", swa_load_segments(b, window, sbs), I32)
    # swa_visible_lo(p) - q_start == max(j - W + 1, valid_start - q_start) for validated input
    # (0 <= valid_start <= q_start), so the pivots need no per-row q_start
    lo_rel = np.maximum(j - (window - 1), _rep(b.valid_start - b.q_start, b))
    em.add(
        "kv_swa_full_index_pivots",
        swa_pivots_rel(j, lo_rel, window, _rep(np.arange(1, n + 1) * window, b),
                       _rep(n * window + b.cu_q[:-1], b)),
        I32,
    )  # fmt: skip

    context = pos + 1
    for r in cfg.ca_ratios:
        key, tpb = ratio_key(r), cfg.tokens_per_block(r)
        cu_ckv = exclusive_cumsum(compressed_kv_len(b.seqlen_k, r))
        check_int32(f"total_k_compressed[{key!r}]", int(cu_ckv[-1]))
        meta.total_k_compressed[key] = int(cu_ckv[-1])
        em.add("cu_compressed_seqlens", cu_ckv, I32, key)
        em.add("load_segments_ca", compressed_load_segments(b, r, tpb, cu_ckv), I32, key)
        # this chunk's new compressed tokens (>= 1 row per sequence)
        valid, rows = num_new_compressed(b.seqlen_q, b.seqlen_k, r)
        cu_rows = exclusive_cumsum(rows)
        em.add("cu_compressed_seqlens_q", cu_rows, I32, key)
        valid = np.where(ph, 0, valid)
        c_seq = np.repeat(np.arange(n, dtype=np.int32), rows)
        k = np.arange(int(cu_rows[-1]), dtype=np.int32) - np.repeat(
            cu_rows[:-1].astype(np.int32), rows
        )
        writes = k < np.repeat(valid.astype(np.int32), rows)
        jc = k + np.repeat((b.q_start // r).astype(np.int32), rows)
        src = np.where(writes, jc // tpb + b.bt_off[:-1].astype(np.int32)[c_seq], 0)
        blk = b.bt_flat[src].astype(np.int32, copy=False) if len(b.bt_flat) else np.int32(0)
        em.add("positions_c", np.where(writes, jc * r, 0), I32, key)
        em.add("slot_mapping_store_ca", np.where(writes, paged_slot(blk, jc, tpb), -1), I32, key)
        # keys: rows [ks, ks + (p + 1) // r) of the loaded compressed buffer
        row_base = _rep(cu_ckv[:-1], b)
        visible = num_complete_groups(context, r)
        if r in cfg.sparse_ratios:
            em.add("ks", row_base, I32, key)
            em.add("ke", row_base + visible, I32, key)
        if r in cfg.dense_ratios:
            off_len = np.empty((total_q, 2), dtype=np.int32)
            off_len[:, 0] = row_base
            off_len[:, 1] = visible
            em.add("kv_ca_index_offset_len", off_len, I32, key)


def prepare_prompt(
    seqs: Sequence[SequenceMetadata], config: MetadataConfig, *, out: dict | None = None
) -> InputMetadata:
    """Build prompt (chunked prefill) metadata for ``seqs``.

    Args:
        seqs: the step's sequences; each chunk is ``token_ids[q_start:seqlen_k]``; no drafts.
        config: engine constants.
        out: optional buffers to write in place (same rules as ``prepare_decode``); the
            segment tables have data-dependent lengths, so their buffers need enough rows.

    ``valid_token_mask`` is ``not is_placeholder`` here; the CP mirror rebuilds it from
    ``mirror_cp_index != -1``.

    Raises:
        ValueError / TypeError naming the sequence, field and value, before anything is written.
    """
    b = extract_batch(seqs, config, is_prompt=True)
    meta = InputMetadata()
    em = Emitter(config.torch_device, out)
    add_base_fields(em, meta, seqs, b, config, is_prompt=True)
    add_prompt_fields(em, b, config, meta)
    em.finish(meta)
    return meta
