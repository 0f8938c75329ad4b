"""``prepare_decode_on_device``: O(n_seq) host extraction + two kernel launches.

Two input forms: a list of ``SequenceMetadata`` (the host walks every object once per
attribute: ~170 of the ~290 us host half for 256 sequences on the dev VM are that CPython
walk) or a :class:`~kvplan.plan.decode_arrays.DecodeBatchArrays` (the same facts as arrays a
scheduler keeps up to date incrementally: a fixed number of numpy calls, ~50 us). Both are
validated before anything is written, with errors naming the field and the value.

From a list, the host reads each sequence's few numbers (lengths, state slot, flags, valid start, block
ids, last token and drafts) in one attribute pass, validates them in bulk and packs them into
ONE int32 array (:func:`kvplan.plan.decode_buffers.write_packed`: a private pinned snapshot
and one ``non_blocking`` copy on CUDA). :mod:`kvplan.plan.decode_kernels` then writes every
per-token field of every ratio and the per-token ``block_tables``. Values equal
:func:`kvplan.plan.decode.prepare_decode` (tests compare field by field).

CUDA graphs: :func:`make_decode_device_out` allocates capture-size buffers once (see
:mod:`kvplan.plan.decode_buffers`); with ``out=`` every step writes their prefixes, so a graph
captured over :func:`launch_decode_kernels` at ``n_cap`` programs replays any smaller batch
staged by :func:`stage_decode_on_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan.plan.batch import BatchArrays, validate_sequence
from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode import decode_ca_offset_check
from kvplan.plan.decode_arrays import (
    DecodeBatchArrays,
    HostDecodeBatch,
    _unsigned,
    block_id_end,
    check_ngram_ids,
    decode_host_batch,
    state_id_end,
)
from kvplan.plan.decode_buffers import (
    bind_buffers,
    make_decode_device_out,
    meta_views,
    write_packed,
)
from kvplan.plan.decode_kernels import (
    DecodeKernelInputs,
    DecodeKernelOutputs,
    DecodeKernelParams,
    launch_decode,
)
from kvplan.plan.metadata import InputMetadata
from kvplan.plan.sequence import SequenceMetadata

__all__ = [
    "DecodeBatchArrays",
    "decode_ngram_ids",
    "extract_decode_batch",
    "launch_decode_kernels",
    "make_decode_device_out",
    "prepare_decode_on_device",
    "stage_decode_on_device",
]

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
    if int(_unsigned(flat).max()) >= block_id_end(cfg):
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


@dataclass
class StagedDecode:
    """What :func:`stage_decode_on_device` hands to :func:`launch_decode_kernels`."""

    meta: InputMetadata
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    block_tables: torch.Tensor  # [q_stride, max_num_blocks]
    params: DecodeKernelParams


DecodeBatch = Sequence[SequenceMetadata] | DecodeBatchArrays


def stage_decode_on_device(
    batch: DecodeBatch, config: MetadataConfig, *, out: dict | None = None
) -> StagedDecode:
    """Host half: validate, extract, pack, copy to the device, set up the metadata views.

    ``batch`` is a list of ``SequenceMetadata`` (one Python pass per attribute over the
    sequences) or a :class:`~kvplan.plan.decode_arrays.DecodeBatchArrays` (a fixed number of
    numpy calls: the fast form for a scheduler that keeps its state in arrays).
    With ``out`` (from :func:`make_decode_device_out`) the buffers are checked (see the module
    docstring) and the step's sizes against their capacity before anything is written; the
    metadata fields are prefix views of those buffers. Without ``out``, exactly sized buffers
    are allocated.
    """
    if isinstance(batch, DecodeBatchArrays):
        hb = decode_host_batch(batch, config)
        ngram = check_ngram_ids(batch, config, len(hb.input_ids))
    else:
        hb = extract_decode_batch(batch, config)
        ngram = decode_ngram_ids(batch, hb, config) if config.max_ngram_size > 0 else None
    n, total_q, max_sq = hb.facts.shape[1], len(hb.input_ids), hb.max_seqlen_q
    decode_ca_offset_check(total_q, config)
    if out is None:
        out = make_decode_device_out(config, n, total_q, max_sq)
    b = bind_buffers(out, config)
    for what, need, have in (
        ("sequences", n, b.cap.num_seqs),
        ("query rows", total_q, b.cap.total_q),
        ("block ids", len(hb.bt_flat), b.cap.num_block_ids),
        ("max_seqlen_q", max_sq, b.cap.max_seqlen_q),
    ):
        if need > have:
            raise ValueError(f"out holds {have} {what}, the step needs {need}")
    # ---- every check passed: write
    cuda = b.packed.is_cuda
    write_packed(b, hb.cus, hb.facts, hb.input_ids, hb.bt_flat)
    views = meta_views(b, out, n, total_q)
    meta = InputMetadata(is_prompt=False, num_seqs=n, total_q=total_q, max_seqlen_q=max_sq,
                         max_seqlen_k=hb.max_seqlen_k)  # fmt: skip
    for name, v in views.items():
        setattr(meta, name, dict(v) if isinstance(v, dict) else v)
    if ngram is not None:
        host = torch.from_numpy(np.ascontiguousarray(ngram, dtype=np.int32))
        meta.ngram_token_ids.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
    return StagedDecode(meta, b.inputs, b.outputs, out["block_tables"], b.params)


def decode_ngram_ids(
    seqs: Sequence[SequenceMetadata], hb: HostDecodeBatch, cfg: MetadataConfig
) -> np.ndarray:
    """Host-side Engram ``ngram_token_ids`` ``[total_q, max_ngram_size]`` of a decode batch."""
    from kvplan.plan.base_fields import ngram_token_ids

    row_seq = np.repeat(np.arange(len(hb.seqlen_q)), hb.seqlen_q)
    row_j = np.arange(len(hb.input_ids)) - hb.cu_q[:-1][row_seq]
    q_start = hb.seqlen_k - hb.seqlen_q
    b = BatchArrays(
        hb.seqlen_q, hb.seqlen_k, q_start, hb.state_id, hb.is_placeholder, hb.valid_start,
        hb.num_blocks, hb.cu_q, hb.cus[1], hb.bt_flat, hb.cus[2], row_seq, row_j,
        q_start[row_seq] + row_j,
    )  # fmt: skip
    return ngram_token_ids(seqs, b, cfg)


def launch_decode_kernels(staged: StagedDecode, backend: str = "auto") -> None:
    """Device half: the metadata kernel and the block-table expansion (graph-capturable);
    ``backend`` as in :func:`kvplan.plan.decode_kernels.launch_decode`."""
    launch_decode(staged.inputs, staged.outputs, staged.block_tables, staged.params, backend)


def prepare_decode_on_device(
    batch: DecodeBatch,
    config: MetadataConfig,
    *,
    out: dict | None = None,
    backend: str = "auto",
) -> InputMetadata:
    """Decode metadata built on the device: O(n_seq) host work + two kernel launches.

    Same fields and values as :func:`kvplan.plan.decode.prepare_decode` (``block_tables``
    columns past a row's blocks are unwritten in both); per-ratio dict entries are row views
    of stacked ``[n_ratio, q_stride, ...]`` buffers.

    Args:
        batch: the decode batch: a list of ``SequenceMetadata`` (``seqlen_q = 1 +
            len(draft_tokens)`` each), or the same facts as a
            :class:`~kvplan.plan.decode_arrays.DecodeBatchArrays` (the fast form: no Python
            walk over the sequences; see that module for why it exists).
        config: engine constants; tensors land on ``config.device``.
        out: capture-size buffers from :func:`make_decode_device_out` (checked, then their
            prefixes are written in place); ``None`` allocates exactly sized buffers.
        backend: ``"auto"`` (CUDA -> Triton, CPU -> torch), ``"triton"`` or ``"torch"``.

    Raises:
        ValueError / TypeError naming the field and value, before anything is written.

    Example::

        out = make_decode_device_out(cfg, max_num_seqs=256, max_total_q=768, max_seqlen_q=3)
        meta = prepare_decode_on_device(seqs, cfg, out=out)   # meta.klen["4"] is out["klen"]["4"][:T]
    """
    staged = stage_decode_on_device(batch, config, out=out)
    launch_decode_kernels(staged, backend)
    return staged.meta
