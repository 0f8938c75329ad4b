"""``DecodeBatchArrays``: a decode batch as a struct of arrays, the fast input of the on-device
decode.

From a list of :class:`~kvplan.plan.sequence.SequenceMetadata` the host has to walk every
sequence object once per attribute each step (lengths, state slot, flags, valid start, last
token, drafts, block table): Python work proportional to ``n``. A scheduler that keeps these
facts in arrays (it updates them incrementally: ``seqlen_k += 1 + accepted`` per row, a block
id appended when a row crosses a block) hands them over as they are, and the host work of a
step becomes a fixed number of numpy calls over ``[n]`` arrays.

Layout (``n`` sequences, CSR block tables)::

    seqlen_q, seqlen_k, state_id, swa_valid_start     int   [n]
    is_placeholder                                    bool  [n] (or int 0/1)
    block_table_offsets                               int   [n + 1], offsets[0] = 0, nondecreasing
    block_table_flat                                  int   [offsets[-1]]
        sequence i's table is block_table_flat[offsets[i]:offsets[i+1]]; at least
        config.num_blocks_for(seqlen_k[i]) entries, extra entries are never read
    input_ids_flat                                    int   [sum seqlen_q]
        per sequence: the last confirmed token, then its seqlen_q - 1 draft tokens
    ngram_token_ids (only with config.max_ngram_size > 0)   int [sum seqlen_q, max_ngram_size]

Example (2 sequences, block_size 4, smallest ratio 1: ``num_blocks_for(k) = ceil(k / 4)``)::

    seqlen_q = [3, 1], seqlen_k = [10, 5]            queries at positions 7..9 and 4
    block_table_offsets = [0, 3, 6]                  seq 0: 3 ids; seq 1: 3 ids (2 needed)
    block_table_flat    = [7, 2, 9,  4, 1, 8]        the trailing 8 is never read
    input_ids_flat      = [t0, d0, d1,  u0]           last confirmed token, then the drafts

``ngram_token_ids`` (Engram) needs each sequence's compressed history, which is not part of
this form: the scheduler supplies the rows (``from_sequences`` computes them on the host).
One choice differs from the list form: ``input_ids_flat`` must fit int32 (the packed device
input is int32); the list form packs token ids without that check.

The arrays are validated (vectorized, every check of ``batch.validate_sequence`` plus the CSR
structure and the block-id range) by :func:`decode_host_batch` each time they are staged, not
at construction: a scheduler may update them in place between steps. Errors name the field,
the index and the value: ``ValueError("seqlen_k[3] = 9: must be >= seqlen_q[3] = 12")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplan._checks import INT32_MAX, check_int32
from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode_extract import (
    HostDecodeBatch,
    as_unsigned,
    block_id_end,
    decode_ngram_ids,
    extract_decode_batch,
    state_id_end,
)

__all__ = ["DecodeBatchArrays", "decode_host_batch"]

_INT_FIELDS = ("seqlen_q", "seqlen_k", "state_id", "swa_valid_start")


@dataclass(frozen=True)
class DecodeBatchArrays:
    """A decode batch as numpy arrays (see the module docstring for the layout)."""

    seqlen_q: np.ndarray
    seqlen_k: np.ndarray
    state_id: np.ndarray
    is_placeholder: np.ndarray
    swa_valid_start: np.ndarray
    block_table_flat: np.ndarray
    block_table_offsets: np.ndarray
    input_ids_flat: np.ndarray
    ngram_token_ids: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seqlen_q)

    @classmethod
    def from_sequences(cls, seqs: Sequence, config: MetadataConfig) -> DecodeBatchArrays:
        """Build the arrays from ``SequenceMetadata`` (validated exactly as ``prepare_decode``
        validates them, same errors). Block tables are stored compact (each sequence's first
        ``num_blocks_for(seqlen_k)`` ids); ``ngram_token_ids`` is computed when the config
        uses Engram n-grams."""
        hb = extract_decode_batch(seqs, config)
        ngram = decode_ngram_ids(seqs, hb, config) if config.max_ngram_size > 0 else None
        i32 = np.int32  # every fact and block id was checked to fit int32; token ids may not
        ids = hb.input_ids
        fits = not len(ids) or int(as_unsigned(ids).max()) <= INT32_MAX
        return cls(
            seqlen_q=hb.facts[0].astype(i32), seqlen_k=hb.facts[1].astype(i32),
            state_id=hb.facts[2].astype(i32), is_placeholder=hb.facts[3] != 0,
            swa_valid_start=hb.facts[4].astype(i32), block_table_flat=hb.bt_flat.astype(i32),
            block_table_offsets=hb.cus[2].astype(i32),
            input_ids_flat=ids.astype(i32) if fits else ids.copy(),
            ngram_token_ids=None if ngram is None else np.asarray(ngram, dtype=np.int64),
        )  # fmt: skip


def _array(name: str, a: object, kinds: str = "iu") -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype.kind not in kinds or a.dtype == np.uint64:
        raise TypeError(f"{name} must have an integer dtype (int64 at most), got {a.dtype}")
    return a


def _fail(name: str, ok: np.ndarray, values: np.ndarray, why: str, other=None) -> None:
    """Raise for the first ``False`` of ``ok``, naming ``name[i]`` and its value."""
    if ok.all():
        return
    i = int(np.flatnonzero(~ok)[0])
    rhs = "" if other is None else f" = {int(other[i])}"
    raise ValueError(f"{name}[{i}] = {int(values[i])}: {why.format(i=i)}{rhs}")


def _check_structure(b: DecodeBatchArrays) -> int:
    """Types, dimensions and sizes of every array; returns ``n``."""
    if not isinstance(b, DecodeBatchArrays):
        raise TypeError(f"batch must be a DecodeBatchArrays, got {type(b).__name__}")
    for name in (*_INT_FIELDS, "block_table_flat", "block_table_offsets", "input_ids_flat"):
        if _array(name, getattr(b, name)).ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {getattr(b, name).shape}")
    if _array("is_placeholder", b.is_placeholder, "biu").ndim != 1:
        raise ValueError(f"is_placeholder must be 1-D, got shape {b.is_placeholder.shape}")
    n = len(b.seqlen_q)
    if n == 0:
        raise ValueError("seqlen_q is empty: a step needs at least one sequence")
    for name in ("seqlen_k", "state_id", "is_placeholder", "swa_valid_start"):
        if len(getattr(b, name)) != n:
            raise ValueError(f"{name} has {len(getattr(b, name))} entries, seqlen_q has {n}")
    if len(b.block_table_offsets) != n + 1:
        raise ValueError(
            f"block_table_offsets has {len(b.block_table_offsets)} entries, needs n + 1 = {n + 1}"
        )
    return n


def _check_values(b: DecodeBatchArrays, facts: np.ndarray, nb: np.ndarray, cfg) -> None:
    """Every per-sequence check, one field at a time (only runs when the fast check failed)."""
    sq, sk, sid, _, vs = facts
    _fail("seqlen_q", sq >= 1, sq, "must be >= 1")
    _fail("seqlen_k", sk >= sq, sk, "must be >= seqlen_q[{i}]", sq)
    _fail("seqlen_k", sk <= cfg.max_model_len, sk, f"exceeds max_model_len = {cfg.max_model_len}")
    _fail("seqlen_q", sq - 1 + cfg.window_size <= cfg.swa_block_size, sq,
          f"window_size {cfg.window_size} + drafts do not fit the SWA ring "
          f"(swa_block_size = {cfg.swa_block_size})")  # fmt: skip
    _fail("swa_valid_start", vs >= 0, vs, "must be >= 0")
    _fail("swa_valid_start", vs <= sk - sq, vs, "must be <= q_start[{i}]", sk - sq)
    _fail("state_id", sid >= 0, sid, "must be >= 0")
    if cfg.num_state_slots is not None:
        _fail("state_id", sid < cfg.num_state_slots, sid,
              f"out of range [0, {cfg.num_state_slots})")  # fmt: skip
    _fail("state_id", sid < (INT32_MAX + 1) // cfg.swa_block_size, sid,
          "state_id * swa_block_size overflows int32")  # fmt: skip
    off = b.block_table_offsets.astype(np.int64)
    bad = np.flatnonzero(off[1:] < off[:-1])
    if len(bad):
        i = int(bad[0]) + 1
        raise ValueError(f"block_table_offsets[{i}] = {int(off[i])}: must be >= "
                         f"block_table_offsets[{i - 1}] = {int(off[i - 1])}")  # fmt: skip
    bad = np.flatnonzero(off[1:] - off[:-1] < nb)
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"block_table_offsets[{i}:{i + 2}] = {off[i : i + 2].tolist()}: row {i} holds "
            f"{int(off[i + 1] - off[i])} block ids, seqlen_k[{i}] = {int(sk[i])} needs "
            f"num_blocks_for = {int(nb[i])}"
        )


def _block_ids(flat: np.ndarray, off: np.ndarray, nb: np.ndarray, cu_nb: np.ndarray, cfg):
    """Each row's first ``nb[i]`` ids, range-checked (``ValueError`` naming the flat index)."""
    if int(off[-1]) != len(flat):
        raise ValueError(
            f"block_table_offsets[-1] = {int(off[-1])} but block_table_flat has {len(flat)} ids"
        )
    if len(flat) == cu_nb[-1] and int(off[0]) == 0:  # compact: every row holds exactly nb ids
        bt = flat
        pos = None
    else:  # gather the used prefix of each row
        row_start = np.repeat(off[:-1] - cu_nb[:-1], nb)
        pos = row_start + np.arange(int(cu_nb[-1]))
        bt = flat[pos]
    if not len(bt):
        return bt
    end = block_id_end(cfg)
    if int(as_unsigned(bt).max()) >= end:  # one pass: negative ids wrap to huge values
        bad = np.flatnonzero((bt < 0) | (bt >= end))[0]
        j = int(bad if pos is None else pos[bad])
        raise ValueError(f"block_table_flat[{j}] = {int(flat[j])}: block id out of range "
                         f"[0, {end}) (num_kv_blocks / int32 slots)")  # fmt: skip
    return bt


def decode_host_batch(b: DecodeBatchArrays, cfg: MetadataConfig) -> HostDecodeBatch:
    """Validate the arrays and derive the packed facts: a fixed number of numpy calls.

    The fast check is one ``[5, n]`` min/max pair plus two elementwise relations; only when
    it fails do the field-by-field checks run to name the first bad index. Nothing is written
    anywhere; the caller writes only after this returns.
    """
    if not isinstance(cfg, MetadataConfig):
        raise TypeError(f"config must be a MetadataConfig, got {type(cfg).__name__}")
    n = _check_structure(b)
    facts = np.empty((5, n), dtype=np.int64)  # 6 calls, cheaper than np.stack's 10+
    facts[0], facts[1], facts[2] = b.seqlen_q, b.seqlen_k, b.state_id
    facts[3], facts[4] = b.is_placeholder, b.swa_valid_start
    if b.is_placeholder.dtype.kind != "b":
        facts[3] = facts[3] != 0
    sq, sk, sid, _, vs = facts
    nb = cfg.num_blocks_for(sk)
    off = b.block_table_offsets
    lo, hi = facts.min(axis=1).tolist(), facts.max(axis=1).tolist()
    sid_end = state_id_end(cfg)
    ok = (
        lo[0] >= 1 and hi[1] <= cfg.max_model_len and lo[2] >= 0 and hi[2] < sid_end
        and lo[4] >= 0 and hi[0] - 1 + cfg.window_size <= cfg.swa_block_size
        and int(off[0]) == 0
        and bool(((sk - sq >= vs) & (off[1:] - off[:-1] >= nb)).all())
    )  # fmt: skip
    if not ok:
        if int(off[0]) != 0:
            raise ValueError(f"block_table_offsets[0] = {int(off[0])}: must be 0")
        _check_values(b, facts, nb, cfg)
        raise AssertionError("vectorized decode array checks disagree with the exact checks")
    cus = np.zeros((3, n + 1), dtype=np.int64)  # cu_q, cu_k, cu_nb
    np.add.accumulate(facts[:2], axis=1, out=cus[:2, 1:])
    np.add.accumulate(nb, out=cus[2, 1:])
    total_q = int(cus[0, -1])
    check_int32("total_q", total_q)
    check_int32("cu_seqlens_k[-1]", int(cus[1, -1]))
    if len(b.input_ids_flat) != total_q:
        raise ValueError(
            f"input_ids_flat has {len(b.input_ids_flat)} ids, sum(seqlen_q) = {total_q}"
        )
    if total_q and int(as_unsigned(b.input_ids_flat).max()) > INT32_MAX:  # negatives wrap
        ids = b.input_ids_flat
        j = int(np.flatnonzero((ids < 0) | (ids > INT32_MAX))[0])
        raise ValueError(f"input_ids_flat[{j}] = {int(ids[j])}: must be in [0, 2**31 - 1]")
    bt = _block_ids(b.block_table_flat, off, nb, cus[2], cfg)
    return HostDecodeBatch(facts, nb, cus, bt, b.input_ids_flat, hi[0], hi[1])


def check_ngram_ids(b: DecodeBatchArrays, cfg: MetadataConfig, total_q: int) -> np.ndarray | None:
    """The batch's ``ngram_token_ids`` ``[total_q, max_ngram_size]``, checked against the
    config (required exactly when ``max_ngram_size > 0``)."""
    g, ng = cfg.max_ngram_size, b.ngram_token_ids
    if g == 0:
        if ng is not None:
            raise ValueError("ngram_token_ids given but config.max_ngram_size = 0")
        return None
    if ng is None:
        raise ValueError(f"ngram_token_ids is required: config.max_ngram_size = {g}")
    _array("ngram_token_ids", ng)
    if ng.shape != (total_q, g):
        raise ValueError(f"ngram_token_ids has shape {ng.shape}, needs ({total_q}, {g})")
    if ng.size and (int(ng.min()) < -INT32_MAX - 1 or int(ng.max()) > INT32_MAX):
        raise ValueError("ngram_token_ids values must fit int32")
    return ng
