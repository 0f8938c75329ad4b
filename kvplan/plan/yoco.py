"""YoCo prefill truncation: two views of one prompt step for the consumer layers.

The consumer layers of a YoCo model only compute the last ``keep_tokens`` positions of each
prompt. With ``data_len = len(token_ids)`` (the prompt length the scheduler knows; every chunk
of a sequence sees the same value) the kept positions form the rectangle::

    rect = [rect_lo, data_len) ∩ [q_start, seqlen_k),   rect_lo = max(0, data_len - keep)

    chunk rows      q_start ..................................... seqlen_k - 1
    rect_lo                          |<------ kept (compact) ------>|
    clip_prefix     |<-- clipped --->|  = clamp(rect_lo - q_start, 0, seqlen_q - 1)

At least one row (the chunk's last) is kept even when the whole chunk lies before the
rectangle, so no sequence has zero rows; such a row sees no SWA key (its window is empty).

The consumer SWA sees raw keys ``max(p - W + 1, swa_valid_start, rect_lo, 0) .. p``: DESIGN.md's
window with ``rect_lo`` as one more lower bound (keys before the rectangle were never computed
by the consumer layers). Compressed visibility is unchanged (the compressed pools are shared).
Both modes use :func:`yoco_swa_visibility`:

* mask mode (``get_mask_view``): every row stays; only ``kv_swa_full_index_pivots`` change;
* compact mode (``get_consumer_view``): only kept rows; their current-chunk SWA keys live in a
  compact section ``[n * W history rows | T_c kept rows]`` (the consumer computes K/V of kept
  rows only), so section 2 starts at ``n * W + cu_c[s] - clip[s]`` for local index ``j``.

Order with CP: :func:`fill_yoco_truncation_metadata` runs on the full layout (before
``prepare_for_mirror_cp``); ``get_consumer_view`` then mirrors the compact rows itself, with the
ORIGINAL ``cu_seqlens_k`` (compact first, then CP).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from kvplan._math import exclusive_cumsum
from kvplan.plan.common import host_int64, swa_pivots
from kvplan.plan.config import MetadataConfig
from kvplan.plan.cp_mirror import (
    apply_mirror,
    cp_mirror_len,
    gather_rows,
    kernel_ratios,
    prepare_cp_mirror,
    zigzag_contrib,
)
from kvplan.plan.metadata_fields import Meta, MetadataFields
from kvplan.plan.sequence import SequenceMetadata


def yoco_rectangle(
    seqlen_q: np.ndarray,
    seqlen_k: np.ndarray,
    data_len: np.ndarray,
    keep_tokens: int,
    compact: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``(rect_lo, clip_prefix)`` per sequence (int64 ``[n]``); ``clip_prefix`` is 0 in mask mode."""
    rect_lo = np.maximum(data_len - keep_tokens, 0)
    if not compact:
        return rect_lo, np.zeros_like(rect_lo)
    return rect_lo, np.clip(rect_lo - (seqlen_k - seqlen_q), 0, seqlen_q - 1)


def yoco_swa_visibility(
    pos, j, q_start, valid_start, rect_lo, window_size: int, sec1_start, sec2_start
) -> np.ndarray:
    """Pivots ``[rows, 4]`` of the consumer SWA (shared by mask and compact modes).

    ``common.swa_pivots`` with ``rect_lo`` as the extra lower bound; ``sec2_start`` is where
    local index 0 of the chunk would sit in section 2 (compact: shifted back by clip_prefix).
    """
    piv = swa_pivots(pos, j, q_start, valid_start, window_size, sec1_start, sec2_start, rect_lo)
    return np.stack(piv, axis=1)


def fill_yoco_truncation_metadata(
    meta: Meta, seqs: Sequence[SequenceMetadata], config: MetadataConfig
) -> Meta:
    """Add the ``yoco_*`` fields of ``config.yoco_mode`` to a FULL-layout prompt ``meta``.

    Mask mode: ``yoco_mask_swa_index_pivots`` [T, 4]. Compact mode (``T_c`` kept rows):
    ``yoco_clip_prefix`` [n], ``yoco_consumer_seqlens_q`` / ``yoco_consumer_cu_seqlens_q``
    [n] / [n + 1], ``yoco_consumer_total_q``, ``yoco_consumer_query_indices`` [T_c] (full-layout
    row of each kept row), ``yoco_consumer_positions``, ``yoco_consumer_slot_mapping_store_swa``
    (the full slot inside the rectangle, else -1), ``yoco_consumer_valid_token_mask``,
    ``yoco_consumer_gate_force_random``, ``yoco_consumer_seq_indices`` (``query_indices``),
    ``yoco_consumer_ks`` / ``_ke`` / ``_kv_ca_index_offset_len`` (the kept rows' values: base
    ``+ (p + 1) // r``), ``yoco_consumer_swa_index_pivots`` [T_c, 4],
    ``yoco_consumer_cp_mirror_len`` and ``yoco_consumer_cp_contrib_pad_len`` (for
    ``config.cp_size``). Also ``yoco_rect_lo`` [n]. Returns ``meta``.
    """
    if config.yoco_mode is None:
        raise ValueError("config.yoco_mode is None: YoCo truncation is off")
    if not meta.is_prompt or getattr(meta, "mirror_cp_index", None) is not None:
        raise ValueError("YoCo truncation needs full-layout prompt metadata (fill before CP)")
    n = meta.num_seqs
    if len(seqs) != n:
        raise ValueError(f"seqs has {len(seqs)} sequences, meta {n}")
    sq, sk = host_int64(meta.seqlens_q), host_int64(meta.seqlens_k)
    data_len = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
    if not np.array_equal(sq, [s.seqlen_q for s in seqs]) or np.any(data_len < sk):
        raise ValueError("seqs do not match meta (seqlen_q differs or len(token_ids) < seqlen_k)")
    vs = np.array([s.swa_valid_start for s in seqs], dtype=np.int64)
    compact = config.yoco_mode == "compact"
    rect_lo, clip = yoco_rectangle(sq, sk, data_len, config.yoco_keep_tokens, compact)
    dev = meta.positions.device
    i32 = lambda a: torch.from_numpy(np.asarray(a).astype(np.int32)).to(dev)
    meta.yoco_rect_lo = i32(rect_lo)
    cu_q = exclusive_cumsum(sq)
    q_start = sk - sq
    w = config.window_size
    if not compact:
        seq = np.repeat(np.arange(n), sq)
        j = np.arange(int(cu_q[-1])) - cu_q[seq]
        piv = yoco_swa_visibility(q_start[seq] + j, j, q_start[seq], vs[seq], rect_lo[seq], w,
                                  seq * w, n * w + cu_q[seq])  # fmt: skip
        meta.yoco_mask_swa_index_pivots = i32(piv)
        return meta
    keep = sq - clip
    cu_c = exclusive_cumsum(keep)
    seq = np.repeat(np.arange(n), keep)
    j = np.arange(int(cu_c[-1])) - cu_c[seq] + clip[seq]  # local index in the full chunk
    rows = cu_q[seq] + j
    pos = q_start[seq] + j
    piv = yoco_swa_visibility(pos, j, q_start[seq], vs[seq], rect_lo[seq], w, seq * w,
                              n * w + cu_c[seq] - clip[seq])  # fmt: skip
    idx = torch.from_numpy(rows).to(dev)
    in_rect = torch.from_numpy(pos >= rect_lo[seq]).to(dev)
    meta.yoco_clip_prefix = i32(clip)
    meta.yoco_consumer_seqlens_q = i32(keep)
    meta.yoco_consumer_cu_seqlens_q = i32(cu_c)
    meta.yoco_consumer_total_q = int(cu_c[-1])
    meta.yoco_consumer_query_indices = i32(rows)
    meta.yoco_consumer_positions = meta.positions[idx]
    swa = meta.slot_mapping_store_swa[idx]
    meta.yoco_consumer_slot_mapping_store_swa = torch.where(in_rect, swa, torch.full_like(swa, -1))
    meta.yoco_consumer_valid_token_mask = meta.valid_token_mask[idx]
    meta.yoco_consumer_gate_force_random = meta.gate_force_random[idx]
    meta.yoco_consumer_seq_indices = meta.query_indices[idx]
    meta.yoco_consumer_ks = {k: v[idx] for k, v in meta.ks.items()}
    meta.yoco_consumer_ke = {k: v[idx] for k, v in meta.ke.items()}
    meta.yoco_consumer_kv_ca_index_offset_len = {
        k: v[idx] for k, v in meta.kv_ca_index_offset_len.items()
    }
    meta.yoco_consumer_swa_index_pivots = i32(piv)
    meta.yoco_consumer_cp_mirror_len = cp_mirror_len(keep, config.cp_size)
    meta.yoco_consumer_cp_contrib_pad_len = int(
        max(zigzag_contrib(sq, clip, config.cp_size, r).sum() for r in range(config.cp_size))
    )
    return meta


def _require(meta: MetadataFields, name: str, mode: str, seqs, config) -> None:
    if getattr(meta, name, None) is None and seqs is not None and config is not None:
        if config.yoco_mode != mode:
            raise ValueError(f"config.yoco_mode is {config.yoco_mode!r}, this view needs {mode!r}")
        fill_yoco_truncation_metadata(meta, seqs, config)
    if getattr(meta, name, None) is None:
        raise ValueError(
            f"meta has no {name}: call fill_yoco_truncation_metadata with yoco_mode={mode!r} "
            "before asking for this view"
        )


def get_mask_view(
    meta: Meta,
    seqs: Sequence[SequenceMetadata] | None = None,
    config: MetadataConfig | None = None,
) -> Meta:
    """Shallow copy whose ``kv_swa_full_index_pivots`` are the mask-mode pivots.

    ``seqs`` / ``config``: fill the YoCo fields first when ``meta`` has none yet.

    Every row stays; derived fields are cleared so ``compute_attn_info`` expands the new
    pivots. Fields not rewritten are SHARED with ``meta``: do not modify them in place. With
    CP (``meta`` already mirrored) the mask pivots are gathered to the mirror rows.
    """
    _require(meta, "yoco_mask_swa_index_pivots", "mask", seqs, config)
    view = copy.copy(meta)
    piv = meta.yoco_mask_swa_index_pivots
    idx = getattr(meta, "mirror_cp_index", None)
    view.kv_swa_full_index_pivots = piv if idx is None else gather_rows(piv, idx, 0)
    view.clean()
    return view


def get_consumer_view(
    meta: Meta,
    seqs: Sequence[SequenceMetadata] | None = None,
    config: MetadataConfig | None = None,
) -> Meta:
    """Shallow copy in the compact layout of the kept rows (see the module docstring).

    ``seqs`` / ``config``: fill the YoCo fields first when ``meta`` has none yet.

    Rewritten: ``positions``, ``slot_mapping_store_swa``, ``valid_token_mask``,
    ``gate_force_random``, ``query_indices``, ``ks``/``ke``, ``kv_ca_index_offset_len``,
    ``kv_swa_full_index_pivots``, ``seqlens_q``, ``cu_seqlens_q``, ``total_q``,
    ``max_seqlen_q``; cleared: ``kv_ca_index``, ``kv_ca_index_len``, ``klen``,
    ``kv_swa_full_index``. Shared with ``meta`` (never modify in place): ``input_ids``,
    ``cu_seqlens_k``, load plans, compressed write slots; ``ngram_token_ids`` is dropped
    (the embedding consumed it). When ``meta`` was mirrored
    (``prepare_for_mirror_cp``), the compact rows are mirrored too, with the original
    ``cu_seqlens_k``, and ``yoco_cp_contrib_index`` / ``yoco_cp_boundary_index`` are set.
    """
    _require(meta, "yoco_consumer_query_indices", "compact", seqs, config)
    view = copy.copy(meta)
    view.positions = meta.yoco_consumer_positions
    view.slot_mapping_store_swa = meta.yoco_consumer_slot_mapping_store_swa
    view.valid_token_mask = meta.yoco_consumer_valid_token_mask
    view.gate_force_random = meta.yoco_consumer_gate_force_random
    view.query_indices = meta.yoco_consumer_seq_indices
    view.ks = dict(meta.yoco_consumer_ks)
    view.ke = dict(meta.yoco_consumer_ke)
    view.kv_ca_index_offset_len = dict(meta.yoco_consumer_kv_ca_index_offset_len)
    view.kv_swa_full_index_pivots = meta.yoco_consumer_swa_index_pivots
    view.seqlens_q = meta.yoco_consumer_seqlens_q
    view.cu_seqlens_q = meta.yoco_consumer_cu_seqlens_q
    view.total_q = meta.yoco_consumer_total_q
    view.max_seqlen_q = int(meta.yoco_consumer_seqlens_q.max())
    view.ngram_token_ids = None  # consumed by the embedding, before any consumer layer
    images = getattr(meta, "images_seq_mask_full", getattr(meta, "images_seq_mask", None))
    if images is not None:
        view.images_seq_mask = images[meta.yoco_consumer_query_indices.long()]
    view.clean()
    if getattr(meta, "mirror_cp_index", None) is None:
        return view
    for name in ("positions_cp", "gate_force_random_cp", "images_seq_mask_full"):
        if hasattr(view, name):
            delattr(view, name)  # the full-layout originals do not describe compact rows
    view.mirror_cp_index = None
    cp_size, cp_rank = meta.cp_size, meta.cp_rank
    m = prepare_cp_mirror(view.cu_seqlens_q, meta.cu_seqlens_k, cp_size, cp_rank,
                          kernel_ratios(view))  # fmt: skip
    assert m.cp_mirror_len == meta.yoco_consumer_cp_mirror_len, "compact mirror length"
    apply_mirror(view, m, cp_size, cp_rank)
    contrib, boundary = yoco_cp_redistribution(meta, m)
    view.yoco_cp_contrib_index = contrib.to(view.positions.device)
    view.yoco_cp_boundary_index = boundary.to(view.positions.device)
    return view


def yoco_cp_redistribution(meta: MetadataFields, m) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices that move kept rows from the full-mirror layout to the compact-mirror layout.

    Each rank sends ``hidden[contrib_index]`` (``[pad_len]``, -1 = pad row) from its
    full-mirror rows; after an all-gather of ``cp_size * pad_len`` rows, compact-mirror row
    ``k`` of this rank reads row ``boundary_index[k]`` (-1 for pad rows).
    """
    cp_size, pad_len = meta.cp_size, meta.yoco_consumer_cp_contrib_pad_len
    cu_q, cu_k = host_int64(meta.cu_seqlens_q), host_int64(meta.cu_seqlens_k)
    kept_rows = host_int64(meta.yoco_consumer_query_indices)
    kept = np.zeros(int(cu_q[-1]), dtype=bool)
    kept[kept_rows] = True
    slot_of = np.full(int(cu_q[-1]), -1, dtype=np.int64)  # global row -> gathered row
    contrib_self = None
    for r in range(cp_size):
        full = host_int64(prepare_cp_mirror(cu_q, cu_k, cp_size, r, ()).mirror_cp_index)
        sel = np.flatnonzero((full >= 0) & kept[np.maximum(full, 0)])
        assert len(sel) <= pad_len, "contribution exceeds the pad length"
        slot_of[full[sel]] = r * pad_len + np.arange(len(sel))
        if r == meta.cp_rank:
            contrib_self = np.full(pad_len, -1, dtype=np.int64)
            contrib_self[: len(sel)] = sel
    compact_idx = host_int64(m.mirror_cp_index)
    boundary = np.where(compact_idx >= 0, slot_of[kept_rows[np.maximum(compact_idx, 0)]], -1)
    as32 = lambda a: torch.from_numpy(a.astype(np.int32))
    return as32(contrib_self), as32(boundary)
