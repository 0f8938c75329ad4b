"""``prepare_decode_on_device``: O(n_seq) host extraction + two kernel launches.

The host reads each sequence's few numbers (lengths, state slot, flags, valid start, block
ids, last token and drafts) in one pass, validates them in bulk and packs them into ONE int32
array that one ``non_blocking`` copy (from a private pinned snapshot) moves to the device.
:mod:`kvplan.plan.decode_kernels` then writes every per-token field of every ratio and the
per-token ``block_tables``. Values equal :func:`kvplan.plan.decode.prepare_decode` (tests
compare field by field).

Packed device inputs (int32), capacities ``n_cap`` sequences, ``q_cap`` rows, ``b_cap`` ids::

    [cu_q | cu_k | bt_off] 3 x (n_cap + 1)     prefix sums; tails past the batch repeat the
    [seqlen_q | seqlen_k | state | placeholder | valid_start] 5 x n_cap     total, so padded
    [ratio table] [input_ids] q_cap [block ids] b_cap       programs see seqlen_q = 0

Only the used prefix (up to the last block id) is copied each step.

CUDA graphs: :func:`make_decode_device_out` allocates capture-size buffers once (per-ratio
fields are row views of stacked ``[n_ratio, q_cap, ...]`` buffers). With ``out=`` they are
checked once (shapes, dtypes, device, stacked rows sharing one storage with equal strides; the
result is cached in ``out["_bound"]`` and re-checked whenever a buffer is replaced) and every
step writes their prefixes, so a graph captured over :func:`launch_decode_kernels` at ``n_cap``
programs replays any smaller batch staged by :func:`stage_decode_on_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np
import torch

from kvplan._checks import INT32_MAX, check_int32
from kvplan.plan.batch import BatchArrays, validate_sequence
from kvplan.plan.common import exclusive_cumsum
from kvplan.plan.config import MetadataConfig, ratio_key
from kvplan.plan.decode import decode_ca_offset_check
from kvplan.plan.decode_kernels import (
    DecodeKernelInputs,
    DecodeKernelOutputs,
    DecodeKernelParams,
    launch_decode,
    ratio_table,
)
from kvplan.plan.metadata import InputMetadata
from kvplan.plan.sequence import SequenceMetadata

_FACTS = attrgetter("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "is_placeholder",
                    "draft_tokens", "token_ids", "block_table")  # fmt: skip
_LAST = itemgetter(-1)
_PER_SEQ = ("seqlen_q", "seqlen_k", "state", "placeholder", "valid_start")


@dataclass(frozen=True)
class DecodeCapacity:
    """Capacities of a set of decode buffers (``max_seqlen_q`` fixes the kernel tile)."""

    num_seqs: int
    total_q: int
    num_block_ids: int
    max_seqlen_q: int
    num_ratios: int

    def sections(self) -> dict[str, tuple[int, int]]:
        """``name -> (offset, length)`` of the packed layout (module docstring)."""
        n = self.num_seqs
        sizes = [("cu_q", n + 1), ("cu_k", n + 1), ("bt_off", n + 1)]
        sizes += [(k, n) for k in _PER_SEQ]
        sizes += [("ratios", self.num_ratios), ("input_ids", self.total_q)]
        sizes += [("bt", self.num_block_ids)]
        offsets = np.cumsum([0] + [s for _, s in sizes]).tolist()
        return {k: (o, s) for (k, s), o in zip(sizes, offsets)}

    def packed_len(self) -> int:
        return (
            3 * (self.num_seqs + 1)
            + 5 * self.num_seqs
            + self.num_ratios
            + self.total_q
            + self.num_block_ids
        )


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


def params_from_config(cfg: MetadataConfig) -> DecodeKernelParams:
    return DecodeKernelParams(
        ca_ratios=cfg.ca_ratios, sparse_ratios=cfg.sparse_ratios, dense_ratios=cfg.dense_ratios,
        block_size=cfg.block_size, window_size=cfg.window_size,
        swa_block_size=cfg.swa_block_size, max_num_blocks=cfg.max_num_blocks,
        force_load_balance=cfg.force_load_balance,
    )  # fmt: skip


_ROW_FIELDS = (  # name, dtype, trailing shape
    ("positions", torch.int32, ()),
    ("valid_token_mask", torch.bool, ()),
    ("gate_force_random", torch.bool, ()),
    ("query_indices", torch.int32, ()),
    ("context_lens", torch.int32, ()),
    ("slot_mapping_store_swa", torch.int32, ()),
    ("state_block_idx", torch.int32, ()),
    ("kv_swa_index_offset_len", torch.int32, (2,)),
)
_RATIO_FIELDS = (  # name, which ratios, trailing shape
    ("positions_c", "ca_ratios", ()),
    ("slot_mapping_store_ca", "ca_ratios", ()),
    ("klen", "sparse_ratios", ()),
    ("kv_ca_index_offset_len", "dense_ratios", (2,)),
)


def make_decode_device_out(
    config: MetadataConfig, max_num_seqs: int, max_total_q: int, max_seqlen_q: int | None = None
) -> dict:
    """Capture-size buffers for ``out=`` on ``config.device``: per-row fields ``[max_total_q,
    ...]``, per-ratio dicts of row views of one stacked ``[n_ratio, max_total_q, ...]`` buffer,
    ``"decode_inputs"`` (packed inputs) and ``"decode_capacity"`` (:class:`DecodeCapacity`).
    ``max_seqlen_q`` (default ``max_total_q``) bounds ``1 + drafts`` and sets the kernel tile.
    """
    for name, v in (("max_num_seqs", max_num_seqs), ("max_total_q", max_total_q)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    q = max_total_q
    cap = DecodeCapacity(max_num_seqs, q, max_num_seqs * config.max_num_blocks,
                         max_seqlen_q or q, len(ratio_table(params_from_config(config))))  # fmt: skip
    dev = config.torch_device
    out: dict = {"decode_capacity": cap}
    out["decode_inputs"] = torch.zeros(cap.packed_len(), dtype=torch.int32, device=dev)
    for name, dtype, tail in _ROW_FIELDS:
        out[name] = torch.empty((q, *tail), dtype=dtype, device=dev)
    out["block_tables"] = torch.empty(q, config.max_num_blocks, dtype=torch.int32, device=dev)
    if config.max_ngram_size > 0:
        out["ngram_token_ids"] = torch.empty(
            q, config.max_ngram_size, dtype=torch.int32, device=dev
        )
    for name, which, tail in _RATIO_FIELDS:
        keys = [ratio_key(r) for r in getattr(config, which)]
        buf = torch.empty((max(len(keys), 1), q, *tail), dtype=torch.int32, device=dev)
        out[name] = {k: buf[i] for i, k in enumerate(keys)}
    return out


def _check_buffer(label: str, t: object, dtype: torch.dtype, rows: int, tail: tuple, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"out {label} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"out {label} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tail or t.shape[0] < rows:
        want = ", ".join([f">= {rows}", *map(str, tail)])
        raise ValueError(f"out {label} has shape {tuple(t.shape)}; needs [{want}]")
    if t.device.type != torch.device(device).type:
        raise ValueError(f"out {label} is on {t.device}, expected {device}")


def stack_rows(
    field: str, rows: dict, keys: list[str], q: int, tail: tuple, device
) -> torch.Tensor:
    """The ``[n_ratio, q_stride, *tail]`` view whose rows are ``rows[k]`` (``k`` in ``keys``).

    The rows must be int32 ``[q_stride >= q, *tail]`` tensors with equal shapes and strides,
    in ONE storage at equally spaced offsets; otherwise ``ValueError`` (the kernel writes every
    ratio through this one view, so a separate tensor would silently miss its writes).
    """
    if not keys:
        return torch.empty((0, 1, *tail), dtype=torch.int32, device=device)
    if not isinstance(rows, dict) or set(keys) - set(rows):
        raise ValueError(f"out[{field!r}] must be a dict holding keys {list(keys)}")
    ts = [rows[k] for k in keys]
    for k, t in zip(keys, ts):
        _check_buffer(f"{field}[{k!r}]", t, torch.int32, q, tail, device)
    t0 = ts[0]
    step = ts[1].storage_offset() - t0.storage_offset() if len(ts) > 1 else t0.numel()
    for i, t in enumerate(ts):
        if (
            t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
            or t.shape != t0.shape
            or t.stride() != t0.stride()
            or t.storage_offset() != t0.storage_offset() + i * step
        ):
            raise ValueError(
                f"out[{field!r}] rows must be equally spaced row views of one stacked buffer "
                f"(same storage, shape and strides); row {keys[i]!r} is not"
            )
    if len(ts) > 1 and step < t0.numel():
        raise ValueError(f"out[{field!r}] rows overlap (row spacing {step} < {t0.numel()})")
    return t0.as_strided((len(ts), *t0.shape), (step, *t0.stride()))


@dataclass
class _Bound:
    """A checked ``out`` dict: the kernel views built once (cached in ``out["_bound"]``)."""

    config: MetadataConfig
    cap: DecodeCapacity
    sources: list  # the out entries checked, for identity re-checks
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    params: DecodeKernelParams
    packed: torch.Tensor  # [packed_len] int32, the device inputs
    sections: dict[str, torch.Tensor]
    offsets: dict[str, tuple[int, int]]
    views: dict = field(default_factory=dict)  # (n, total_q) -> meta field views

    def still_valid(self, out: dict, config: MetadataConfig) -> bool:
        if not (config is self.config or config == self.config):
            return False
        return all(
            (out.get(k) is v) if not isinstance(v, dict)
            else isinstance(out.get(k), dict) and all(out[k].get(kk) is vv for kk, vv in v.items())
            for k, v in self.sources
        )  # fmt: skip


def _bind(out: dict, config: MetadataConfig) -> _Bound:
    """Check every buffer of ``out`` at its capacity and build the kernel views."""
    bound = out.get("_bound")
    if isinstance(bound, _Bound) and bound.still_valid(out, config):
        return bound
    cap, dev = out.get("decode_capacity"), config.torch_device
    if not isinstance(cap, DecodeCapacity):
        raise ValueError("out must come from make_decode_device_out (no 'decode_capacity')")
    prm = params_from_config(config)
    if (
        cap.num_ratios != len(ratio_table(prm))
        or cap.num_block_ids < cap.num_seqs * config.max_num_blocks
    ):
        raise ValueError("out was made for another config (ratio table or block capacity)")
    _check_buffer("decode_inputs", out.get("decode_inputs"), torch.int32, cap.packed_len(), (), dev)
    names = [n for n, _, _ in _ROW_FIELDS] + ["block_tables"]
    for name, dtype, tail in (
        *_ROW_FIELDS,
        ("block_tables", torch.int32, (config.max_num_blocks,)),
    ):
        _check_buffer(name, out.get(name), dtype, cap.total_q, tail, dev)
    if config.max_ngram_size > 0:
        names.append("ngram_token_ids")
        _check_buffer("ngram_token_ids", out.get("ngram_token_ids"), torch.int32, cap.total_q,
                      (config.max_ngram_size,), dev)  # fmt: skip
    stacks = {}
    for name, which, tail in _RATIO_FIELDS:
        keys = [ratio_key(r) for r in getattr(config, which)]
        stacks[name] = stack_rows(name, out.get(name), keys, cap.total_q, tail, dev)
    packed = out["decode_inputs"]
    sec = {k: packed[o : o + s] for k, (o, s) in cap.sections().items()}
    inputs = DecodeKernelInputs(
        cu_seqlens_q=sec["cu_q"], seqlens_k=sec["seqlen_k"], state_ids=sec["state"],
        is_placeholder=sec["placeholder"], swa_valid_start=sec["valid_start"],
        block_tables_in=sec["bt"], block_tables_offsets=sec["bt_off"], ratios=sec["ratios"],
        max_seqlen_q=cap.max_seqlen_q,
    )  # fmt: skip
    outputs = DecodeKernelOutputs(*(out[n] for n, _, _ in _ROW_FIELDS), **stacks)
    sources = [(k, out[k]) for k in ["decode_inputs", *names]]
    sources += [(k, dict(out[k])) for k, _, _ in _RATIO_FIELDS]
    bound = _Bound(config, cap, sources, inputs, outputs, prm, packed, sec, cap.sections())
    out["_bound"] = bound
    return bound


def _meta_views(b: _Bound, out: dict, n: int, total_q: int) -> dict:
    """Prefix views of every metadata tensor for a batch of ``n`` sequences / ``total_q`` rows
    (cached per shape: a decode loop cycles through few shapes)."""
    views = b.views.get((n, total_q))
    if views is None:
        sec = b.sections
        views = {"cu_seqlens_q": sec["cu_q"][: n + 1], "cu_seqlens_k": sec["cu_k"][: n + 1],
                 "seqlens_q": sec["seqlen_q"][:n], "seqlens_k": sec["seqlen_k"][:n],
                 "input_ids": sec["input_ids"][:total_q],
                 "block_tables": out["block_tables"][:total_q]}  # fmt: skip
        for name, _, _ in _ROW_FIELDS:
            views[name] = out[name][:total_q]
        if "ngram_token_ids" in out and b.config.max_ngram_size > 0:
            views["ngram_token_ids"] = out["ngram_token_ids"][:total_q]
        for name, _, _ in _RATIO_FIELDS:
            stack = getattr(b.outputs, name)
            views[name] = {k: stack[i, :total_q] for i, k in enumerate(out[name])}
        if len(b.views) >= 64:  # bounded: a long run may see many (n, total_q) shapes
            b.views.clear()
        b.views[(n, total_q)] = views
    return views


@dataclass
class StagedDecode:
    """What :func:`stage_decode_on_device` hands to :func:`launch_decode_kernels`."""

    meta: InputMetadata
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    block_tables: torch.Tensor  # [q_stride, max_num_blocks]
    params: DecodeKernelParams


def _write_packed(hb: HostDecodeBatch, b: _Bound, ratios: list[int], cuda: bool) -> None:
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
    for name, arr in zip(_PER_SEQ, (hb.seqlen_q, hb.seqlen_k, hb.state_id, hb.is_placeholder,
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
    b = _bind(out, config)
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
    _write_packed(hb, b, ratio_table(b.params), cuda)
    views = _meta_views(b, out, n, total_q)
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
