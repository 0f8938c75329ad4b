"""Host facts of a decode batch: ``HostDecodeBatch`` and its extraction from a sequence list.

``extract_decode_batch`` reads each ``SequenceMetadata``'s few numbers (lengths, state slot,
flags, valid start, block ids, last token and drafts) in one attribute pass, validates them in
bulk and returns the packed facts that ``decode_device`` stages (``decode_arrays`` builds the
same ``HostDecodeBatch`` from a struct of arrays). The bounds shared by both forms
(``block_id_end``, ``state_id_end``) live here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np

from kvplan._checks import INT32_MAX, check_int32
from kvplan.plan.base_fields import ngram_token_ids
from kvplan.plan.batch import BatchArrays, validate_sequence
from kvplan.plan.config import MetadataConfig
from kvplan.plan.sequence import SequenceMetadata

__all__ = [
    "HostDecodeBatch",
    "as_unsigned",
    "block_id_end",
    "decode_ngram_ids",
    "extract_decode_batch",
    "state_id_end",
]


@dataclass
class HostDecodeBatch:
    """Validated per-sequence facts of a decode batch, in the packed layout's order.

    ``facts`` is int64 ``[5, n]``: seqlen_q, seqlen_k, state_id, is_placeholder (0/1),
    swa_valid_start (the ``PER_SEQ_SECTIONS`` order); ``cus`` is int64 ``[3, n + 1]``: the
    exclusive prefix sums of seqlen_q, seqlen_k and num_blocks; ``bt_flat`` int
    ``[sum num_blocks]`` holds each sequence's first ``num_blocks`` block ids; ``input_ids``
    int ``[total_q]`` the last confirmed token then the drafts of each sequence.
    """

    facts: np.ndarray
    num_blocks: np.ndarray  # [n]
    cus: np.ndarray
    bt_flat: np.ndarray
    input_ids: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int

    seqlen_q = property(lambda self: self.facts[0])
    seqlen_k = property(lambda self: self.facts[1])
    state_id = property(lambda self: self.facts[2])
    is_placeholder = property(lambda self: self.facts[3] != 0)
    valid_start = property(lambda self: self.facts[4])
    cu_q = property(lambda self: self.cus[0])


def as_unsigned(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as unsigned (no copy): a negative value reads as >= 2**(bits - 1)."""
    return a.view(f"u{a.itemsize}") if a.dtype.kind == "i" else a


def block_id_end(cfg: MetadataConfig) -> int:
    """Exclusive bound of a valid block id: below ``num_kv_blocks`` (when set) and
    ``(id + 1) * block_size - 1`` fits int32."""
    end = (INT32_MAX + 1) // cfg.block_size
    return end if cfg.num_kv_blocks is None else min(end, cfg.num_kv_blocks)


def state_id_end(cfg: MetadataConfig) -> int:
    """Exclusive bound of a valid state id: below ``num_state_slots`` (when set) and
    ``(sid + 1) * swa_block_size - 1`` fits int32."""
    end = (INT32_MAX + 1) // cfg.swa_block_size
    return end if cfg.num_state_slots is None else min(end, cfg.num_state_slots)


# attribute order = the packed per-sequence section order, then the three sized fields
_FACTS = attrgetter("seqlen_q", "seqlen_k", "state_id", "is_placeholder", "swa_valid_start",
                    "draft_tokens", "token_ids", "block_table")  # fmt: skip
_LAST = itemgetter(-1)


def _is_int_column(values: tuple) -> bool:
    """True when every entry is an int, bool or numpy integer: their sum is then one too (a
    float, string, None or other object makes it a float, an object, or raise)."""
    try:
        total = sum(values)
    except (TypeError, ValueError, OverflowError):  # e.g. None, "3", -1 + np.uint64
        return False
    return isinstance(total, int | np.integer)


def _int_facts(cols: list, n: int) -> np.ndarray | None:
    """The first five attribute columns as int64 ``[5, n]`` (placeholder flags as 0/1 by
    truth value), or ``None`` when a numeric fact is not an integer (the slow path names it).
    ``np.fromiter`` alone would truncate ``2.5`` or parse ``"3"``, hence the column check."""
    if not all(map(_is_int_column, cols[:3] + cols[4:5])):
        return None
    flags = cols[3] if _is_int_column(cols[3]) else tuple(map(bool, cols[3]))
    try:
        facts = np.fromiter(chain(*cols[:3], flags, cols[4]), dtype=np.int64, count=5 * n)
    except OverflowError:  # beyond int64: out of every range, the slow path names it
        return None
    facts = facts.reshape(5, n)
    facts[3] = facts[3] != 0
    return facts


def _checks_pass(facts: np.ndarray, lo: list, hi: list, lens: np.ndarray, nb: np.ndarray,
                 cfg: MetadataConfig) -> bool:  # fmt: skip
    """The vectorized mirror of ``batch.validate_sequence`` for decode: the bounds of single
    fields through their batch min (``lo``) and max (``hi``), relations elementwise."""
    (sq_min, _, sid_min, _, vs_min), (sq_max, sk_max, sid_max, _, _) = lo, hi
    sid_end = state_id_end(cfg)
    if not (
        sq_min >= 1 and sk_max <= cfg.max_model_len and sid_min >= 0 and sid_max < sid_end
        and vs_min >= 0 and sq_max - 1 + cfg.window_size <= cfg.swa_block_size
    ):  # fmt: skip
        return False
    sq, sk, vs = facts[0], facts[1], facts[4]
    q_start = sk - sq  # vs >= 0 and q_start >= vs also give seqlen_k >= seqlen_q
    n_draft, n_tok, n_bt = lens
    ok = (q_start >= vs) & (n_draft == sq - 1) & (n_tok == q_start + 1) & (n_bt >= nb)
    return bool(ok.all())


def _check_block_ids(bt: np.ndarray, cu_nb: np.ndarray, cfg: MetadataConfig) -> None:
    """Exact range checks of the compact block ids (``ValueError`` naming the sequence)."""
    lo, hi = int(bt.min()), int(bt.max())
    if lo < 0 or (cfg.num_kv_blocks is not None and hi >= cfg.num_kv_blocks):
        bad = lo if lo < 0 else hi
        i = int(np.searchsorted(cu_nb[1:], int(np.flatnonzero(bt == bad)[0]), "right"))
        raise ValueError(
            f"seqs[{i}].block_table = {bad}: block id out of range [0, {cfg.num_kv_blocks})"
        )
    check_int32("block id * block_size", (hi + 1) * cfg.block_size - 1)


def _block_ids(tables: tuple, n_bt: np.ndarray, nb: np.ndarray, cu_nb: np.ndarray,
               cfg: MetadataConfig) -> np.ndarray:  # fmt: skip
    """Each table's first ``nb[i]`` ids, concatenated (int64), range-checked.

    Every table is concatenated once and the spare entries past ``nb[i]`` (never read, so
    they may hold anything) are dropped with one boolean mask. In the concatenation the
    spare of global rank ``g`` (counting spares across tables) belonging to sequence ``i``
    sits at ``cu_nb[i + 1] + g``::

        tables [a0 a1 x] [b0] [c0 c1 y z], nb = [2, 1, 2], cu_nb[1:] = [2, 3, 5]
        flat    a0 a1 x b0 c0 c1 y z       spares x, y, z (g = 0, 1, 2) at 2+0, 5+1, 5+2

    The range check runs once over all entries, spares included (a single unsigned max:
    negative ids wrap to huge values), and only when that fails again, exactly, on the
    compact ids, so that a bad spare entry is ignored and a bad used one reported with its
    sequence.
    """
    flat = np.concatenate(tables) if tables else np.zeros(0, np.int64)
    if not len(flat):
        return np.zeros(0, np.int64)
    if flat.dtype.kind not in "iu":
        raise TypeError(f"block_table entries must be integers, got dtype {flat.dtype}")
    spare = n_bt - nb
    num_spare = len(flat) - int(cu_nb[-1])
    if num_spare:
        keep = np.ones(len(flat), dtype=bool)
        keep[np.repeat(cu_nb[1:], spare) + np.arange(num_spare)] = False
        bt = flat[keep]
    else:
        bt = flat
    if int(as_unsigned(flat).max()) >= block_id_end(cfg):
        _check_block_ids(bt, cu_nb, cfg)  # exact: raises unless only spares were bad
    return bt.astype(np.int64, copy=False)


def _input_ids(cols: list, cus: np.ndarray, sq_min: int, sq_max: int) -> np.ndarray:
    """``[total_q]`` int64: per sequence the last confirmed token, then its drafts."""
    n, total_q = len(cols[6]), int(cus[0, -1])
    lasts = np.fromiter(map(_LAST, cols[6]), dtype=np.int64, count=n)
    if total_q == n:
        return lasts
    drafts = np.fromiter(chain.from_iterable(cols[5]), dtype=np.int64, count=total_q - n)
    ids = np.empty(total_q, dtype=np.int64)
    if sq_min == sq_max:  # every sequence has the same number of drafts: a [n, sq] view
        rows = ids.reshape(n, sq_max)
        rows[:, 0] = lasts
        rows[:, 1:] = drafts.reshape(n, sq_max - 1)
    else:
        first = cus[0, :-1]
        is_draft = np.ones(total_q, dtype=bool)
        is_draft[first] = False
        ids[first] = lasts
        ids[is_draft] = drafts
    return ids


def extract_decode_batch(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> HostDecodeBatch:
    """Validate and gather the decode batch: one attribute pass over the sequences, the rest in
    numpy. When a vectorized check fails (or a fact is not an integer) every sequence goes
    through ``batch.validate_sequence``, so errors name the sequence, field and value exactly
    as ``prepare_decode`` does. Nothing is written anywhere before all checks pass.

    Cost (256 sequences): the attribute pass and ``len`` of 768 sequences are the Python part;
    everything else is a fixed number of numpy calls over ``[n]`` arrays, plus one
    concatenation, one boolean compaction (only when tables hold spare entries) and one
    range reduction over the block ids.
    """
    if not isinstance(cfg, MetadataConfig):
        raise TypeError(f"config must be a MetadataConfig, got {type(cfg).__name__}")
    n = len(seqs)
    if n == 0:
        raise ValueError("seqs is empty: a step needs at least one sequence")
    if set(map(type, seqs)) != {SequenceMetadata}:
        for i, s in enumerate(seqs):
            if not isinstance(s, SequenceMetadata):
                raise TypeError(f"seqs[{i}] must be a SequenceMetadata, got {type(s).__name__}")
    cols = list(zip(*map(_FACTS, seqs)))
    facts = _int_facts(cols, n)  # [5, n] int64 in the packed order, None if not all ints
    lens = np.fromiter(map(len, chain(*cols[5:])), dtype=np.int64, count=3 * n).reshape(3, n)
    good = facts is not None
    if good:
        nb = cfg.num_blocks_for(facts[1])
        lo, hi = facts.min(axis=1).tolist(), facts.max(axis=1).tolist()
    if not (good and _checks_pass(facts, lo, hi, lens, nb, cfg)):
        for i, s in enumerate(seqs):  # raises with the exact field and value
            validate_sequence(i, s, cfg, is_prompt=False)
        raise AssertionError("vectorized decode checks disagree with validate_sequence")
    cus = np.zeros((3, n + 1), dtype=np.int64)  # cu_q, cu_k, cu_nb
    np.add.accumulate(facts[:2], axis=1, out=cus[:2, 1:])
    np.add.accumulate(nb, out=cus[2, 1:])
    check_int32("total_q", int(cus[0, -1]))
    check_int32("cu_seqlens_k[-1]", int(cus[1, -1]))
    bt_flat = _block_ids(cols[7], lens[2], nb, cus[2], cfg)
    input_ids = _input_ids(cols, cus, lo[0], hi[0])
    return HostDecodeBatch(facts, nb, cus, bt_flat, input_ids, hi[0], hi[1])


def decode_ngram_ids(
    seqs: Sequence[SequenceMetadata], hb: HostDecodeBatch, cfg: MetadataConfig
) -> np.ndarray:
    """Host-side Engram ``ngram_token_ids`` ``[total_q, max_ngram_size]`` of a decode batch."""
    row_seq = np.repeat(np.arange(len(hb.seqlen_q)), hb.seqlen_q)
    row_j = np.arange(len(hb.input_ids)) - hb.cu_q[:-1][row_seq]
    q_start = hb.seqlen_k - hb.seqlen_q
    b = BatchArrays(
        hb.seqlen_q, hb.seqlen_k, q_start, hb.state_id, hb.is_placeholder, hb.valid_start,
        hb.num_blocks, hb.cu_q, hb.cus[1], hb.bt_flat, hb.cus[2], row_seq, row_j,
        q_start[row_seq] + row_j,
    )  # fmt: skip
    return ngram_token_ids(seqs, b, cfg)
