"""Correctness oracle: what each query row can see, expanded from the metadata alone.

DESIGN.md's visibility rules for a query at absolute position ``p`` (window ``W``, ratio ``r``):

* ``"swa"``: raw keys ``max(p - W + 1, swa_valid_start, 0) .. p``;
* ``"ca{r}"``: compressed tokens ``j = 0 .. (p + 1) // r - 1`` (dense ratios read them all;
  sparse ratios let the indexer choose among them, so the oracle lets it choose all).

:func:`visible_rows` derives the same sets from an ``InputMetadata`` without a model: it
simulates the caches (a ring per state slot, a paged pool per ratio, filled with the history
the scheduler's state implies), applies the step's writes (``slot_mapping_store_*``), runs the
load plans into tagged buffers and follows the expanded indices (``kv_swa_full_index``,
``kv_swa_index``, ``ks``/``ke``, ``kv_ca_index``, ``convert_kv_index`` through
``block_tables``). Every entry a row reaches carries a tag ``(seq, position)``; zero rows,
stale ring slots (below ``swa_valid_start``), other sequences' keys and duplicates are errors.
CP-mirror and YoCo tests extend this with their own row maps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvplan.plan.common import host_int64
from kvplan.plan.config import MetadataConfig, ratio_key
from kvplan.plan.sequence import SequenceMetadata

Visible = dict[str, set[int]]
ZERO = ("zero",)


def source(ratio: int) -> str:
    """Visibility source name of compressed ratio ``ratio``: ``"ca4"``."""
    return f"ca{ratio}"


def expected_row(p: int, valid_start: int, cfg: MetadataConfig) -> Visible:
    """DESIGN.md's visible set of a query at ``p``."""
    lo = max(p - cfg.window_size + 1, valid_start, 0)
    vis = {"swa": set(range(lo, p + 1))}
    for r in cfg.ca_ratios:
        vis[source(r)] = set(range((p + 1) // r))
    return vis


def expected_visible(
    seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, rows: Sequence[int] | None = None
) -> list:
    """Per query row (batch order) the expected :data:`Visible`; ``None`` for placeholders
    (and for rows not in ``rows`` when given)."""
    wanted = None if rows is None else set(rows)
    out, t = [], 0
    for s in seqs:
        for j in range(s.seqlen_q):
            p = s.seqlen_k - s.seqlen_q + j
            skip = s.is_placeholder or (wanted is not None and t not in wanted)
            out.append(None if skip else expected_row(p, s.swa_valid_start, cfg))
            t += 1
    return out


@dataclass
class CacheModel:
    """Tagged cache contents: ``ring[slot]`` and ``pool[ratio_key][slot]`` -> tag."""

    ring: dict[int, tuple] = field(default_factory=dict)
    pool: dict[str, dict[int, tuple]] = field(default_factory=dict)


def _paged(s: SequenceMetadata, j: int, tpb: int) -> int:
    return int(s.block_table[j // tpb]) * tpb + j % tpb


def history_cache(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> CacheModel:
    """The caches before the step, as earlier steps left them (placeholders own nothing)."""
    sbs = cfg.swa_block_size
    cache = CacheModel(pool={ratio_key(r): {} for r in cfg.ca_ratios})
    for i, s in enumerate(seqs):
        if s.is_placeholder:
            continue
        q_start = s.seqlen_k - s.seqlen_q
        for q in range(max(0, q_start - sbs), q_start):
            tag = (i, q) if q >= s.swa_valid_start else ("stale", i, q)
            cache.ring[s.state_id * sbs + q % sbs] = tag
        for r in cfg.ca_ratios:
            tpb = cfg.tokens_per_block(r)
            for j in range(q_start // r):
                cache.pool[ratio_key(r)][_paged(s, j, tpb)] = (i, j)
    return cache


def _row_seq(meta) -> np.ndarray:
    cu = host_int64(meta.cu_seqlens_q)
    return np.repeat(np.arange(len(cu) - 1), np.diff(cu))


def apply_writes(cache: CacheModel, meta, cfg: MetadataConfig) -> list[str]:
    """Apply the step's SWA and compressed stores; returns errors (misplaced tokens)."""
    errors = []
    row_seq, pos = _row_seq(meta), host_int64(meta.positions)
    for t, slot in enumerate(host_int64(meta.slot_mapping_store_swa)):
        if slot != -1:
            cache.ring[int(slot)] = (int(row_seq[t]), int(pos[t]))
    for r in cfg.ca_ratios:
        key = ratio_key(r)
        pos_c, slots = (
            host_int64(meta.positions_c[key]),
            host_int64(meta.slot_mapping_store_ca[key]),
        )
        if meta.is_prompt:
            cu = host_int64(meta.cu_compressed_seqlens_q[key])
            c_seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        else:
            c_seq = row_seq
        for k, slot in enumerate(slots):
            if slot == -1:
                continue
            if pos_c[k] % r:
                errors.append(f"positions_c[{key!r}][{k}] = {pos_c[k]} is not a multiple of {r}")
            cache.pool[key][int(slot)] = (int(c_seq[k]), int(pos_c[k]) // r)
    return errors


def check_cache_after(cache: CacheModel, seqs, cfg: MetadataConfig) -> list[str]:
    """After the step the ring holds each sequence's last valid positions and the pool every
    complete compressed token, at their canonical slots (what the next step will read)."""
    errors, sbs = [], cfg.swa_block_size
    for i, s in enumerate(seqs):
        if s.is_placeholder:
            continue
        for q in range(max(s.seqlen_k - sbs, s.swa_valid_start, 0), s.seqlen_k):
            got = cache.ring.get(s.state_id * sbs + q % sbs)
            if got != (i, q):
                errors.append(f"seq {i}: ring slot of position {q} holds {got}")
        for r in cfg.ca_ratios:
            tpb = cfg.tokens_per_block(r)
            for j in range(s.seqlen_k // r):
                got = cache.pool[ratio_key(r)].get(_paged(s, j, tpb))
                if got != (i, j):
                    errors.append(f"seq {i}: compressed token {j} of ratio {r} holds {got}")
    return errors


def run_load_plan(segments: torch.Tensor, total_k: int, src: dict, block: int) -> list:
    """Tagged output of ``load_paged_kv_cache``: row -> tag (``ZERO`` for zero fill)."""
    buf: list = [None] * total_k
    for b, begin, end, dst in host_int64(segments).reshape(-1, 4):
        for k in range(end - begin):
            buf[dst + k] = ZERO if b == -1 else src.get(int(b) * block + int(begin) + k, ("miss",))
    return buf


def run_compressed_load_plans(meta, cache: CacheModel, cfg: MetadataConfig) -> dict:
    """Tagged compressed buffer of every ratio, from a prompt step's ``load_segments_ca``."""
    return {
        ratio_key(r): run_load_plan(
            meta.load_segments_ca[ratio_key(r)],
            meta.total_k_compressed[ratio_key(r)],
            cache.pool[ratio_key(r)],
            cfg.tokens_per_block(r),
        )
        for r in cfg.ca_ratios
    }


def _at(buf: list, x: int) -> tuple:
    return buf[x] if 0 <= x < len(buf) else ("outside the buffer", int(x))


def _collect(tags: list, seq: int, name: str, row: int, vis: Visible, errors: list) -> None:
    got = []
    for tag in tags:
        if isinstance(tag, tuple) and len(tag) == 2 and tag[0] == seq:
            got.append(tag[1])
        else:
            errors.append(f"row {row}: {name} reaches {tag} (sequence {seq})")
    if len(set(got)) != len(got):
        errors.append(f"row {row}: {name} has duplicates {sorted(got)}")
    vis[name] = set(got)


def _placeholder_writes(meta, seqs, cfg: MetadataConfig) -> list[str]:
    """Placeholder sequences must not write any cache."""
    errors, row_seq = [], _row_seq(meta)
    placeholder = np.array([s.is_placeholder for s in seqs], dtype=bool)
    bad = placeholder[row_seq] & (host_int64(meta.slot_mapping_store_swa) != -1)
    errors += [f"placeholder row {t} stores SWA" for t in np.flatnonzero(bad)]
    for r in cfg.ca_ratios:
        key = ratio_key(r)
        if meta.is_prompt:
            cu = host_int64(meta.cu_compressed_seqlens_q[key])
            c_seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        else:
            c_seq = row_seq
        bad = placeholder[c_seq] & (host_int64(meta.slot_mapping_store_ca[key]) != -1)
        errors += [f"placeholder row {k} stores compressed {key}" for k in np.flatnonzero(bad)]
    return errors


def visible_rows(
    meta, seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, rows: Sequence[int] | None = None
) -> tuple:
    """``(visible, errors)``: per query row the :data:`Visible` the metadata describes (``None``
    for placeholder rows, which are only checked to write nothing, and for rows not in
    ``rows`` when given) and a list of errors.

    Calls ``meta.compute_attn_info(cfg)`` first (a no-op when already expanded).
    """
    meta.compute_attn_info(cfg)
    cache = history_cache(seqs, cfg)
    errors = _placeholder_writes(meta, seqs, cfg)
    row_seq, n = _row_seq(meta), meta.num_seqs
    sbs, window = cfg.swa_block_size, cfg.window_size
    if meta.is_prompt:
        # prefill loads the SWA history BEFORE it stores the chunk (the store may overwrite
        # ring slots the window reads); compressed tokens are stored before their load
        swa_buf = run_load_plan(meta.load_segments_swa, meta.total_k_swa, cache.ring, sbs)
        swa_buf += [(int(i), int(p)) for i, p in zip(row_seq, host_int64(meta.positions))]
        if meta.total_k_swa != n * window:
            errors.append(f"total_k_swa = {meta.total_k_swa}, expected n * W = {n * window}")
    errors += apply_writes(cache, meta, cfg)
    errors += check_cache_after(cache, seqs, cfg)
    if meta.is_prompt:
        ca_buf = run_compressed_load_plans(meta, cache, cfg)
        swa_idx = host_int64(meta.kv_swa_full_index)
    else:
        swa_idx = host_int64(meta.kv_swa_index)
    ca_idx = {k: host_int64(v) for k, v in meta.kv_ca_index.items()}
    if meta.is_prompt:
        # the attention kernel reads [SWA history | chunk | compressed] through kv_index_cat:
        # follow the compressed part of the concatenated index (shifted by the SWA rows)
        from kvplan.ops import kv_index_cat

        base = n * window + meta.total_q
        for k, v in meta.kv_ca_index.items():
            cat = host_int64(kv_index_cat(meta.kv_swa_full_index, v, base, check=True))
            if not np.array_equal(cat[:, :window], swa_idx):
                errors.append(f"kv_index_cat changed the SWA part of ratio {k}")
            right = cat[:, window:]
            ca_idx[k] = np.where(right == -1, -1, right - base)
    sparse_slots = {} if meta.is_prompt else _decode_sparse_slots(meta, cfg)
    placeholder = [s.is_placeholder for s in seqs]
    wanted = set(range(meta.total_q)) if rows is None else set(rows)
    result = []
    for t in range(meta.total_q):
        i = int(row_seq[t])
        if placeholder[i] or t not in wanted:
            result.append(None)
            continue
        vis: Visible = {}
        ids = [x for x in swa_idx[t] if x != -1]
        tags = (
            [_at(swa_buf, x) for x in ids] if meta.is_prompt else [cache.ring.get(x) for x in ids]
        )
        _collect(tags, i, "swa", t, vis, errors)
        for r in cfg.ca_ratios:
            key = ratio_key(r)
            if r in cfg.dense_ratios:
                ids = [x for x in ca_idx[key][t] if x != -1]
            elif meta.is_prompt:
                ids = list(range(int(meta.ks[key][t]), int(meta.ke[key][t])))
            else:
                ids = [x for x in sparse_slots[key][t] if x != -1]
            if meta.is_prompt:
                tags = [_at(ca_buf[key], x) for x in ids]
            else:
                tags = [cache.pool[key].get(x) for x in ids]
            _collect(tags, i, source(r), t, vis, errors)
        result.append(vis)
    return result, errors


def _decode_sparse_slots(meta, cfg: MetadataConfig) -> dict[str, np.ndarray]:
    """Decode sparse ratios: an indexer that picks every candidate ``0 .. klen - 1``, converted
    to pool slots by ``convert_kv_index`` through ``block_tables``."""
    from kvplan.ops import convert_kv_index

    out = {}
    for r in cfg.sparse_ratios:
        key = ratio_key(r)
        klen = meta.klen[key]
        width = max(int(klen.max()), 1)
        topk = torch.arange(width, dtype=torch.int32, device=klen.device).repeat(len(klen), 1)
        topk = torch.where(topk < klen[:, None], topk, -1).to(torch.int32).contiguous()
        slots = convert_kv_index(topk, meta.block_tables, klen, cfg.tokens_per_block(r), check=True)
        out[key] = host_int64(slots)
    return out


def check_visibility(
    meta, seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, rows: Sequence[int] | None = None
) -> None:
    """Raise ``AssertionError`` listing the first differences between the metadata's visible
    sets and DESIGN.md's, and any misplaced write or stray entry (``rows``: only those)."""
    got_rows, errors = visible_rows(meta, seqs, cfg, rows)
    expected = expected_visible(seqs, cfg, rows)
    for t, (got, want) in enumerate(zip(got_rows, expected, strict=True)):
        if got is None or want is None:
            continue
        for name in want:
            if got.get(name) != want[name]:
                g, w = got.get(name, set()), want[name]
                errors.append(
                    f"row {t} {name}: extra {sorted(g - w)[:8]}, missing {sorted(w - g)[:8]}"
                )
    if errors:
        raise AssertionError(f"{len(errors)} visibility errors:\n" + "\n".join(errors[:10]))
