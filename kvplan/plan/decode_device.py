"""``prepare_decode_on_device``: O(n_seq) host extraction + two kernel launches.

The host reads each sequence's few numbers (lengths, state slot, flags, valid start, block
ids, last token and drafts) in one pass, validates them in bulk and packs them into ONE int32
array that one ``non_blocking`` copy (from a private pinned snapshot) moves to the device.
:mod:`kvplan.plan.decode_kernels` then writes every per-token field of every ratio and the
per-token ``block_tables``. Values equal :func:`kvplan.plan.decode.prepare_decode` (tests
compare field by field).

The packed layout, the capture-size ``out=`` buffers and their checks live in
:mod:`kvplan.plan.decode_buffers`. Only the used prefix of the packed inputs (up to the last
block id) is written and copied each step.

CUDA graphs: :func:`make_decode_device_out` allocates capture-size buffers once (per-ratio
fields are row views of stacked ``[n_ratio, q_cap, ...]`` buffers). With ``out=`` they are
checked once (cached until a buffer is replaced) and every step writes their prefixes, so a
graph captured over :func:`launch_decode_kernels` at ``n_cap`` programs replays any smaller
batch staged by :func:`stage_decode_on_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np
import torch

from kvplan._checks import INT32_MAX, check_int32
from kvplan.plan.batch import BatchArrays, validate_sequence
from kvplan.plan.common import exclusive_cumsum
from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode import decode_ca_offset_check
from kvplan.plan.decode_buffers import (
    PER_SEQ_SECTIONS,
    BoundBuffers,
    bind_buffers,
    make_decode_device_out,
    meta_views,
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
    "launch_decode_kernels",
    "make_decode_device_out",
    "prepare_decode_on_device",
    "stage_decode_on_device",
]

_FACTS = attrgetter("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "is_placeholder",
                    "draft_tokens", "token_ids", "block_table")  # fmt: skip
_LAST = itemgetter(-1)


@dataclass
class HostDecodeBatch:
    """Validated per-sequence facts (numpy int64 ``[n]``), compact block ids, input tokens."""

    seqlen_q: np.ndarray
    seqlen_k: np.ndarray
    state_id: np.ndarray
    valid_start: np.ndarray
    is_placeholder: np.ndarray
    num_blocks: np.ndarray
    cu_q: np.ndarray  # [n + 1]
    bt_flat: np.ndarray
    input_ids: np.ndarray  # [total_q]


def _checks_pass(ints: np.ndarray, lens: np.ndarray, nb: np.ndarray, cfg: MetadataConfig):
    """The vectorized mirror of ``batch.validate_sequence`` for decode."""
    sq, sk, sid, vs = ints[:4]
    n_draft, n_tok, n_bt = lens
    ok = (
        (sq >= 1) & (sk >= sq) & (sk <= cfg.max_model_len) & (sq == 1 + n_draft)
        & (n_tok == sk - sq + 1) & (sq - 1 + cfg.window_size <= cfg.swa_block_size)
        & (vs >= 0) & (vs <= sk - sq) & (sid >= 0) & (n_bt >= nb)
        & ((sid + 1) * cfg.swa_block_size - 1 <= INT32_MAX)
    )  # fmt: skip
    if cfg.num_state_slots is not None:
        ok &= sid < cfg.num_state_slots
    return bool(ok.all())


def extract_decode_batch(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> HostDecodeBatch:
    """Validate and gather the decode batch: one attribute pass over the sequences, the rest in
    numpy. When a vectorized check fails (or a fact is not an integer) every sequence goes
    through ``batch.validate_sequence``, so errors name the sequence, field and value exactly
    as ``prepare_decode`` does. Nothing is written anywhere before all checks pass.
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
    ints = np.array(cols[:5])  # [5, n]: seqlen_q, seqlen_k, state_id, valid_start, placeholder
    lens = np.fromiter(map(len, chain(*cols[5:])), dtype=np.int64, count=3 * n).reshape(3, n)
    tpb = cfg.tokens_per_block(cfg.min_ratio)
    good = ints.dtype.kind in "iub"
    nb = -(-(ints[1].astype(np.int64) // cfg.min_ratio) // tpb) if good else None
    if not (good and _checks_pass(ints, lens, nb, cfg)):
        for i, s in enumerate(seqs):  # raises with the exact field and value
            validate_sequence(i, s, cfg, is_prompt=False)
        raise AssertionError("vectorized decode checks disagree with validate_sequence")
    ints = ints.astype(np.int64, copy=False)
    sq, sk = ints[0], ints[1]
    total_q = int(sq.sum())
    check_int32("total_q", total_q)
    check_int32("cu_seqlens_k[-1]", int(sk.sum()))
    # block ids: every table concatenated, then the first nb[i] of each gathered
    tables = np.concatenate(cols[7]).astype(np.int64, copy=False)
    cu_nb = exclusive_cumsum(nb)
    if np.array_equal(lens[2], nb):  # every table exactly as long as needed
        bt_flat = tables
    else:
        extra = exclusive_cumsum(lens[2])[:-1] - cu_nb[:-1]
        bt_flat = tables[np.repeat(extra, nb) + np.arange(int(cu_nb[-1]))]
    if len(bt_flat):
        lo, hi = int(bt_flat.min()), int(bt_flat.max())
        if lo < 0 or (cfg.num_kv_blocks is not None and hi >= cfg.num_kv_blocks):
            bad = lo if lo < 0 else hi
            i = int(np.searchsorted(cu_nb[1:], int(np.flatnonzero(bt_flat == bad)[0]), "right"))
            raise ValueError(
                f"seqs[{i}].block_table = {bad}: block id out of range [0, {cfg.num_kv_blocks})"
            )
        check_int32("block id * block_size", (hi + 1) * cfg.block_size - 1)
    # input ids: the last confirmed token, then the drafts
    cu_q = exclusive_cumsum(sq)
    input_ids = np.empty(total_q, dtype=np.int64)
    first = cu_q[:-1]
    input_ids[first] = list(map(_LAST, cols[6]))
    if total_q > n:
        is_draft = np.ones(total_q, dtype=bool)
        is_draft[first] = False
        input_ids[is_draft] = list(chain.from_iterable(cols[5]))
    return HostDecodeBatch(sq, sk, ints[2], ints[3], ints[4].astype(bool), nb, cu_q, bt_flat,
                           input_ids)  # fmt: skip


@dataclass
class StagedDecode:
    """What :func:`stage_decode_on_device` hands to :func:`launch_decode_kernels`."""

    meta: InputMetadata
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    block_tables: torch.Tensor  # [q_stride, max_num_blocks]
    params: DecodeKernelParams


def _write_packed(hb: HostDecodeBatch, b: BoundBuffers, ratios: list[int], cuda: bool) -> None:
    """Write the used prefix of the packed inputs (module docstring)."""
    n = len(hb.seqlen_q)
    sec = b.offsets
    used = sec["bt"][0] + len(hb.bt_flat)
    # CUDA: a private pinned snapshot, copied async; CPU: write the buffer itself (no copy,
    # and no torch intra-op thread hand-off on a busy host)
    host = torch.empty(used, dtype=torch.int32, pin_memory=True) if cuda else None
    h = host.numpy() if cuda else b.packed.numpy()[:used]
    for name, lengths in (("cu_q", hb.seqlen_q), ("cu_k", hb.seqlen_k), ("bt_off", hb.num_blocks)):
        off, size = sec[name]
        h[off : off + n + 1] = exclusive_cumsum(lengths)
        h[off + n + 1 : off + size] = h[off + n]
    for name, arr in zip(PER_SEQ_SECTIONS, (hb.seqlen_q, hb.seqlen_k, hb.state_id, hb.is_placeholder,
                                     hb.valid_start)):  # fmt: skip
        h[sec[name][0] : sec[name][0] + n] = arr
    h[sec["ratios"][0] : sec["ratios"][0] + len(ratios)] = ratios
    h[sec["input_ids"][0] : sec["input_ids"][0] + len(hb.input_ids)] = hb.input_ids
    h[sec["bt"][0] : used] = hb.bt_flat
    if cuda:
        b.packed[:used].copy_(host, non_blocking=True)


def stage_decode_on_device(
    seqs: Sequence[SequenceMetadata], config: MetadataConfig, *, out: dict | None = None
) -> StagedDecode:
    """Host half: validate, extract, pack, copy to the device, set up the metadata views.

    With ``out`` (from :func:`make_decode_device_out`) the buffers are checked (see the module
    docstring) and the step's sizes against their capacity before anything is written; the
    metadata fields are prefix views of those buffers. Without ``out``, exactly sized buffers
    are allocated.
    """
    hb = extract_decode_batch(seqs, config)
    n, total_q, max_sq = len(hb.seqlen_q), len(hb.input_ids), int(hb.seqlen_q.max())
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
    ngram = None
    if config.max_ngram_size > 0:
        from kvplan.plan.base_fields import ngram_token_ids

        ngram = ngram_token_ids(seqs, _batch_arrays(hb), config)
    # ---- every check passed: write
    cuda = config.torch_device.type == "cuda"
    _write_packed(hb, b, b.ratios, cuda)
    views = meta_views(b, out, n, total_q)
    meta = InputMetadata(is_prompt=False, num_seqs=n, total_q=total_q, max_seqlen_q=max_sq,
                         max_seqlen_k=int(hb.seqlen_k.max()))  # fmt: skip
    for name, v in views.items():
        setattr(meta, name, dict(v) if isinstance(v, dict) else v)
    if ngram is not None:
        host = torch.from_numpy(np.ascontiguousarray(ngram, dtype=np.int32))
        meta.ngram_token_ids.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
    return StagedDecode(meta, b.inputs, b.outputs, out["block_tables"], b.params)


def _batch_arrays(hb: HostDecodeBatch) -> BatchArrays:
    """``batch.BatchArrays`` of the decode batch (only for the host-side Engram n-grams)."""
    row_seq = np.repeat(np.arange(len(hb.seqlen_q)), hb.seqlen_q)
    row_j = np.arange(len(hb.input_ids)) - hb.cu_q[:-1][row_seq]
    q_start = hb.seqlen_k - hb.seqlen_q
    return BatchArrays(
        hb.seqlen_q, hb.seqlen_k, q_start, hb.state_id, hb.is_placeholder, hb.valid_start,
        hb.num_blocks, hb.cu_q, exclusive_cumsum(hb.seqlen_k), hb.bt_flat,
        exclusive_cumsum(hb.num_blocks), row_seq, row_j, q_start[row_seq] + row_j,
    )  # fmt: skip


def launch_decode_kernels(staged: StagedDecode, backend: str = "auto") -> None:
    """Device half: the metadata kernel and the block-table expansion (graph-capturable);
    ``backend`` as in :func:`kvplan.plan.decode_kernels.launch_decode`."""
    launch_decode(staged.inputs, staged.outputs, staged.block_tables, staged.params, backend)


def prepare_decode_on_device(
    seqs: Sequence[SequenceMetadata],
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
        seqs: the decode batch (``seqlen_q = 1 + len(draft_tokens)`` each).
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
    staged = stage_decode_on_device(seqs, config, out=out)
    launch_decode_kernels(staged, backend)
    return staged.meta
