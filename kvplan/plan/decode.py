"""``prepare_decode``: eager decode metadata, vectorized over query rows (numpy on the host).

A decode step of a sequence has ``seqlen_q = 1 + len(draft_tokens)`` rows at positions
``q_start .. seqlen_k - 1``. Every row's KV is stored (ring and compressed pools) before any
row reads, so each row's window includes itself::

    ring of swa_block_size slots (state_id):   ... [lo % sbs ........ p % sbs] ...
    kv_swa_index_offset_len[row] = (state_id * sbs + lo % sbs, p - lo + 1)
    lo = max(p - W + 1, swa_valid_start, 0)

``swa_valid_start`` is honored here too, so the visible set is
``max(p - W + 1, swa_valid_start, 0) .. p`` on every path.
The ring must hold the window plus the drafts written in the same step
(``window_size + seqlen_q - 1 <= swa_block_size``, checked).

Compressed tokens: row ``p`` completes group ``p // r`` when ``(p + 1) % r == 0``; it then
stores compressed token ``jc = p // r`` (``positions_c = jc * r``) at
``block_table[jc // tpb] * tpb + jc % tpb`` (``tpb = block_size // r``). Other rows: 0 / -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan.plan.base_fields import add_base_fields
from kvplan.plan.batch import BatchArrays, Emitter, extract_batch
from kvplan.plan.common import (
    completes_group,
    num_complete_groups,
    paged_slot,
    ring_slot,
    swa_stores,
    swa_visible_lo,
)
from kvplan.plan.config import MetadataConfig, ratio_key
from kvplan.plan.metadata import InputMetadata
from kvplan.plan.sequence import SequenceMetadata

I32 = torch.int32


def expand_block_tables(b: BatchArrays) -> np.ndarray:
    """Rows of ``block_tables``: int32 [T, width], row ``i`` starting with its sequence's
    ``num_blocks`` block ids (``width`` = the longest table of the batch; entries past a row's
    blocks are arbitrary). The field is ``[T, max_num_blocks]``; columns from ``width`` on are
    not written (``Emitter.add(..., width=max_num_blocks)``)."""
    n = b.num_seqs
    width = int(b.num_blocks.max()) if n else 0
    per_seq = np.empty((n, width), dtype=np.int32)
    if width:
        per_seq[np.arange(width)[None, :] < b.num_blocks[:, None]] = b.bt_flat
    return np.repeat(per_seq, b.seqlen_q, axis=0)


def decode_ca_offset_check(total_q: int, cfg: MetadataConfig) -> None:
    """int32 check of decode ``kv_ca_index_offset_len`` offsets (``row * max_num_blocks * tpb``)."""
    if cfg.dense_ratios:
        tpb = cfg.tokens_per_block(min(cfg.dense_ratios))
        check_int32(
            "total_q * max_num_blocks * (block_size // min(dense_ratios))",
            total_q * cfg.max_num_blocks * tpb,
        )


def add_decode_fields(em: Emitter, b: BatchArrays, cfg: MetadataConfig) -> None:
    """Every decode-specific field (see the module docstring)."""
    seq, pos, j = b.row_seq, b.row_pos, b.row_j
    total_q = b.total_q
    row_ph = b.is_placeholder[seq]
    row_sid = b.state_id[seq]
    sbs, window = cfg.swa_block_size, cfg.window_size
    decode_ca_offset_check(total_q, cfg)

    em.add("state_block_idx", row_sid, I32)
    stores = swa_stores(b.seqlen_q[seq], j, sbs) & ~row_ph
    em.add("slot_mapping_store_swa", np.where(stores, ring_slot(row_sid, pos, sbs), -1), I32)
    em.add("context_lens", pos + 1, I32)
    lo = swa_visible_lo(pos, window, b.valid_start[seq])
    em.add("kv_swa_index_offset_len", np.stack([ring_slot(row_sid, lo, sbs), pos - lo + 1], 1), I32)
    em.add("block_tables", expand_block_tables(b), I32, width=cfg.max_num_blocks)
    row_bt_off = b.bt_off[:-1][seq]
    for r in cfg.ca_ratios:
        key = ratio_key(r)
        tpb = cfg.tokens_per_block(r)
        writes = completes_group(pos, r) & ~row_ph
        jc = pos // r
        blk = b.bt_flat[np.where(writes, row_bt_off + jc // tpb, 0)] if len(b.bt_flat) else 0
        em.add("positions_c", np.where(writes, jc * r, 0), I32, key)
        em.add("slot_mapping_store_ca", np.where(writes, paged_slot(blk, jc, tpb), -1), I32, key)
    for r in cfg.sparse_ratios:
        em.add("klen", num_complete_groups(pos + 1, r), I32, ratio_key(r))
    rows = np.arange(total_q, dtype=np.int64)
    for r in cfg.dense_ratios:
        offset = rows * (cfg.max_num_blocks * cfg.tokens_per_block(r))
        em.add(
            "kv_ca_index_offset_len",
            np.stack([offset, num_complete_groups(pos + 1, r)], 1),
            I32,
            ratio_key(r),
        )


def prepare_decode(
    seqs: Sequence[SequenceMetadata], config: MetadataConfig, *, out: dict | None = None
) -> InputMetadata:
    """Build decode metadata for ``seqs`` (each ``seqlen_q = 1 + len(draft_tokens)``).

    Args:
        seqs: the step's sequences, in batch order.
        config: engine constants.
        out: optional capture-size buffers (field -> tensor, per-ratio fields -> dict of
            tensors) on ``config.device``; every emitted field must be present with the same
            dtype and trailing shape and at least as many rows. Their prefixes are written in
            place and the metadata fields are those prefix views. Without ``out`` fresh tensors
            are allocated (pinned + ``non_blocking`` copy when the device is CUDA).

    Raises:
        ValueError / TypeError naming the sequence, field and value (bad lengths, too-short
        block tables, ids out of range, int32 overflow, wrong ``out`` buffers), before any
        tensor is written.

    Example (window 4, ring 6, ratio 2, block_size 4, one sequence with one draft)::

        seqlen_k = 7, seqlen_q = 2 -> rows at p = 5, 6
        positions = [5, 6]; context_lens = [6, 7]; klen["2"] = [3, 3]
        kv_swa_index_offset_len = [[sid*6 + 2, 4], [sid*6 + 3, 4]]
        positions_c["2"] = [4, 0]; slot_mapping_store_ca["2"] = [bt[1]*2 + 0, -1]
    """
    b = extract_batch(seqs, config, is_prompt=False)
    meta = InputMetadata()
    em = Emitter(config.torch_device, out)
    add_base_fields(em, meta, seqs, b, config, is_prompt=False)
    add_decode_fields(em, b, config)
    em.finish(meta)
    return meta
