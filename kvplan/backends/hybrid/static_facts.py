"""The per-step host facts of a static decode step in O(batch) Python work.

`kvplan.backends.hybrid.static_step.StaticDecodeStep.stage` turns its decode rows (plus
padding rows) into a :class:`~kvplan.plan.decode_arrays.DecodeBatchArrays` and the per-row
arrays the compressor-state plan needs. The block tables are what grows with context: a
table of Python ints converted to numpy costs time proportional to its length. They change
rarely (a block is appended every ``block_size`` tokens), so :class:`BlockTableCache` keeps,
per state slot, the last table seen and its numpy form with the length of its valid prefix:

* a ``list`` hits when it equals the stored copy (``==`` compares the int objects, by
  identity first: a table handed again, or one appended to, costs a pointer compare per
  entry; a table changed in place misses);
* a ``tuple`` or ``range`` (immutable) hits when it is the stored object, or equals it;
* a batch of numpy arrays (the engine's views) skips the cache: the used prefixes are
  concatenated and range-checked in one pass.

:func:`decode_rows` returns ``None`` (the caller then takes the exact path over
``SequenceMetadata``, whose checks name the sequence, field and value) unless every check that
path runs passes: the fast checks are the same conditions, vectorized, so both paths accept
the same batches and stage the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, getitem

import numpy as np

from kvplan._checks import INT32_MAX
from kvplan.backends.hybrid.api import HybridSeq
from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode_arrays import DecodeBatchArrays
from kvplan.plan.decode_extract import as_unsigned, block_id_end, state_id_end

_ROW = attrgetter("q_start", "seqlen_q", "state_id", "token_ids", "block_table")
_IMMUTABLE = (tuple, range)


class BlockTableCache:
    """Per state slot: the last block table seen, its int64 numpy form and the length of its
    leading run of valid block ids (module docstring). Bounded by the number of slots."""

    def __init__(self, config: MetadataConfig) -> None:
        self.end = block_id_end(config)
        self._rows: dict[int, tuple[object, np.ndarray, int]] = {}
        self.num_converted = 0  # tables converted to numpy (misses), for tests and profiles

    def row(self, state_id: int, table: object) -> tuple[np.ndarray, int] | None:
        """``(ids, num_valid)`` of ``table`` (``ids[:num_valid]`` are valid block ids), or
        ``None`` when the table is not a 1-D integer sequence this cache handles."""
        if isinstance(table, np.ndarray):
            return self._convert(table)
        kind = type(table)
        hit = self._rows.get(state_id)
        if hit is not None and type(hit[0]) is kind and (hit[0] is table or hit[0] == table):
            return hit[1], hit[2]
        if kind is list:
            copy = list(table)
        elif kind in _IMMUTABLE:
            copy = table
        else:
            return None
        got = self._convert(copy)
        if got is not None:
            self._rows[state_id] = (copy, *got)
        return got

    def _convert(self, table: object) -> tuple[np.ndarray, int] | None:
        self.num_converted += 1
        try:
            ids = np.asarray(table)
        except (TypeError, ValueError, OverflowError):
            return None
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.dtype == np.uint64:
            return None if len(ids) else (np.zeros(0, np.int64), 0)
        ids = ids.astype(np.int64, copy=False)
        bad = np.flatnonzero(as_unsigned(ids) >= self.end)  # negatives wrap to huge values
        return ids, int(bad[0]) if len(bad) else len(ids)


@dataclass
class DecodeRows:
    """A static step's rows (decode rows, then padding) as arrays: the packed decode facts
    and the compressor-state inputs (int64 ``[num_rows]`` each)."""

    batch: DecodeBatchArrays
    q_start: np.ndarray
    state_id: np.ndarray
    is_placeholder: np.ndarray

    @property
    def input_ids(self) -> np.ndarray:
        return self.batch.input_ids_flat


def _array_prefixes(tables: tuple, counts: list[int], end: int) -> list[np.ndarray] | None:
    """When every table is a numpy array (the engine's views of its block tables): the used
    prefix of each, checked at once (1-D integers, long enough, every used id in ``[0, end)``);
    ``[]`` when a check fails; ``None`` when some table is not an array."""
    if not tables or any(type(t) is not np.ndarray for t in tables):
        return None
    parts = []
    for t, k in zip(tables, counts):
        if t.ndim != 1 or t.dtype.kind not in "iu" or t.dtype == np.uint64 or len(t) < k:
            return []
        parts.append(t[:k])
    used = np.concatenate(parts).astype(np.int64, copy=False)
    if used.size and int(as_unsigned(used).max()) >= end:
        return []
    return parts


def decode_rows(seqs: list, num_rows: int, config: MetadataConfig,
                cache: BlockTableCache) -> DecodeRows | None:  # fmt: skip
    """The rows of a static step over ``seqs`` (``len(seqs) <= num_rows``; padding rows:
    position 0, no block, state slot 0, placeholder), or ``None`` when any check of the exact
    path would fail or a fact is not a plain int (module docstring)."""
    n, cfg = len(seqs), config
    if n and set(map(type, seqs)) != {HybridSeq}:
        return None
    cols = list(zip(*map(_ROW, seqs))) if n else [()] * 5
    qs_col, sq_col, sid_col, toks, tables = cols
    if n and not set(map(type, qs_col + sq_col + sid_col)) <= {int}:
        return None
    if n and (sq_col.count(1) != n or any(map(int.__le__, map(len, toks), qs_col))):
        return None
    tokens = list(map(getitem, toks, qs_col))
    if n and not set(map(type, tokens)) <= {int}:
        return None
    pad = num_rows - n
    qs = np.zeros(num_rows, dtype=np.int64)
    sid = np.zeros(num_rows, dtype=np.int64)
    ids = np.zeros(num_rows, dtype=np.int64)
    qs[:n], sid[:n], ids[:n] = qs_col, sid_col, tokens
    sk = qs + 1
    if n and not (
        int(qs[:n].min()) >= 0 and int(sk.max()) <= cfg.max_model_len
        and int(sid[:n].min()) >= 0 and int(sid.max()) < state_id_end(cfg)
        and int(as_unsigned(ids).max()) <= INT32_MAX and int(sk.sum()) <= INT32_MAX
    ):  # fmt: skip
        return None
    nb = np.asarray(cfg.num_blocks_for(sk), dtype=np.int64)
    counts = nb[:n].tolist()
    parts = _array_prefixes(tables, counts, cache.end)
    if parts is None:  # Python sequences: through the per-slot cache
        parts, row = [], cache.row
        for s, table, k in zip(sid_col, tables, counts):
            got = row(s, table)
            if got is None or got[1] < k:  # not ints, too short, or a used id out of range
                return None
            parts.append(got[0][:k])
    elif not parts and n:
        return None
    if pad:
        parts.append(np.zeros(int(nb[n:].sum()), dtype=np.int64))
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(nb, out=offsets[1:])
    ph = np.zeros(num_rows, dtype=bool)
    ph[n:] = True
    batch = DecodeBatchArrays(
        seqlen_q=np.ones(num_rows, dtype=np.int64), seqlen_k=sk, state_id=sid,
        is_placeholder=ph, swa_valid_start=np.zeros(num_rows, dtype=np.int64),
        block_table_flat=(np.concatenate(parts).astype(np.int64, copy=False) if parts
                          else np.zeros(0, np.int64)),
        block_table_offsets=offsets, input_ids_flat=ids,
    )  # fmt: skip
    return DecodeRows(batch, qs, sid, ph)
