"""``prepare_decode_on_device``: O(n_seq) host extraction + two kernel launches.

The host reads each sequence's few numbers (lengths, state slot, flags, valid start, the
first ``num_blocks`` block ids, the last token and the drafts), validates them in bulk and packs
them into ONE int32 array that one ``non_blocking`` copy (from a private pinned snapshot) moves
to the device. :mod:`kvplan.plan.decode_kernels` then writes every per-token field of every
ratio (``decode_metadata``) and the per-token ``block_tables`` (``expand_block_tables``).
Field semantics equal :func:`kvplan.plan.decode.prepare_decode` (tests compare field by field).

Packed device inputs (int32), with capacities ``n_cap`` (sequences), ``q_cap`` (query rows)
and ``b_cap`` (block ids)::

    [cu_q | cu_k | bt_off]  3 x (n_cap + 1)   tails past the real batch repeat the total, so
    [seqlens_q | seqlens_k | state | placeholder | valid_start]   5 x n_cap   padded programs
    [input_ids] q_cap    [block ids] b_cap                                    see seqlen_q = 0

CUDA graphs: :func:`make_decode_device_out` allocates capture-size buffers once; with
``out=`` every step writes their prefixes (per-ratio fields are row views of stacked
``[n_ratio, q_cap, ...]`` buffers, checked to share one storage with equal row strides), so a
graph captured over :func:`launch_decode_kernels` at ``n_cap`` programs replays any smaller
batch after :func:`stage_decode_on_device` has refreshed the packed inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

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
    decode_metadata,
    decode_metadata_torch,
    decode_metadata_triton,
    expand_block_tables,
    expand_block_tables_torch,
    expand_block_tables_triton,
    ratio_table,
)
from kvplan.plan.metadata import InputMetadata
from kvplan.plan.sequence import SequenceMetadata

_INTS = attrgetter("seqlen_q", "seqlen_k", "state_id", "swa_valid_start")
_SIZES = attrgetter("draft_tokens", "token_ids", "block_table")


@dataclass(frozen=True)
class DecodeCapacity:
    """Capacities of a set of decode buffers (``max_seqlen_q`` fixes the kernel tile)."""

    num_seqs: int
    total_q: int
    num_block_ids: int
    max_seqlen_q: int
    num_ratios: int  # entries of the ratio table (>= 1)

    def packed_len(self) -> int:
        n = self.num_seqs
        return 3 * (n + 1) + 5 * n + self.total_q + self.num_block_ids + self.num_ratios


@dataclass
class HostDecodeBatch:
    """Per-sequence facts (numpy int64 ``[n]``) after validation; ``bt_flat`` / ``input_ids``
    are the compact block ids and the ``[total_q]`` input tokens."""

    seqlen_q: np.ndarray
    seqlen_k: np.ndarray
    state_id: np.ndarray
    valid_start: np.ndarray
    is_placeholder: np.ndarray
    num_blocks: np.ndarray
    bt_flat: np.ndarray
    input_ids: np.ndarray

    @property
    def num_seqs(self) -> int:
        return len(self.seqlen_q)

    @property
    def total_q(self) -> int:
        return int(self.seqlen_q.sum())


def _num_blocks(seqlen_k: np.ndarray, cfg: MetadataConfig) -> np.ndarray:
    tpb = cfg.tokens_per_block(cfg.min_ratio)
    return -(-(seqlen_k // cfg.min_ratio) // tpb)  # = cfg.num_blocks_for, vectorized


def extract_decode_batch(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> HostDecodeBatch:
    """Validate and gather the decode batch in a few passes over the sequences (O(n_seq)).

    Checks are vectorized; when one fails (or a value is not a plain ``int``), every sequence
    goes through ``batch.validate_sequence`` so the error names the sequence, field and value
    exactly as ``prepare_decode`` does. Nothing is written before all checks pass.
    """
    if not isinstance(cfg, MetadataConfig):
        raise TypeError(f"config must be a MetadataConfig, got {type(cfg).__name__}")
    n = len(seqs)
    if n == 0:
        raise ValueError("seqs is empty: a step needs at least one sequence")
    if not all(type(s) is SequenceMetadata for s in seqs):
        for i, s in enumerate(seqs):
            if not isinstance(s, SequenceMetadata):
                raise TypeError(f"seqs[{i}] must be a SequenceMetadata, got {type(s).__name__}")
    flat = list(chain.from_iterable(map(_INTS, seqs)))
    ph = np.fromiter(map(attrgetter("is_placeholder"), seqs), dtype=bool, count=n)
    sizes = list(map(_SIZES, seqs))
    if set(map(type, flat)) <= {int}:
        ints = np.array(flat, dtype=np.int64).reshape(n, 4)
        sq, sk, sid, vs = ints.T
    else:
        sq = sk = sid = vs = None
    lens = np.fromiter(map(len, chain.from_iterable(sizes)), dtype=np.int64, count=3 * n)
    n_draft, n_tok, n_bt = lens.reshape(n, 3).T
    ok = sq is not None
    if ok:
        nb = _num_blocks(sk, cfg)
        ok = bool(
            np.all(sq >= 1)
            & np.all(sk >= sq)
            & np.all(sk <= cfg.max_model_len)
            & np.all(sq == 1 + n_draft)
            & np.all(n_tok == sk - sq + 1)
            & np.all(sq - 1 + cfg.window_size <= cfg.swa_block_size)
            & np.all((vs >= 0) & (vs <= sk - sq))
            & np.all(sid >= 0)
            & np.all((sid + 1) * cfg.swa_block_size - 1 <= INT32_MAX)
            & np.all(n_bt >= nb)
        )
        if ok and cfg.num_state_slots is not None:
            ok = bool(np.all(sid < cfg.num_state_slots))
    if not ok:
        for i, s in enumerate(seqs):  # raises with the exact field and value
            validate_sequence(i, s, cfg, is_prompt=False)
        if sq is None:  # numpy integers: valid, convert the slow way
            sq, sk, sid, vs = (np.array([int(x) for x in flat[k::4]]) for k in range(4))
            nb = _num_blocks(sk, cfg)
        else:
            raise AssertionError("vectorized decode checks disagree with validate_sequence")
    nb_list = nb.tolist()
    bt_flat = np.concatenate([np.asarray(t[2][:k]) for t, k in zip(sizes, nb_list)])
    bt_flat = bt_flat.astype(np.int64, copy=False)
    if len(bt_flat):
        lo, hi = int(bt_flat.min()), int(bt_flat.max())
        bad = lo if lo < 0 else hi
        if lo < 0 or (cfg.num_kv_blocks is not None and hi >= cfg.num_kv_blocks):
            pos = int(np.flatnonzero(bt_flat == bad)[0])
            i = int(np.searchsorted(np.cumsum(nb), pos, side="right"))
            raise ValueError(
                f"seqs[{i}].block_table = {bad}: block id out of range [0, {cfg.num_kv_blocks})"
            )
        check_int32("block id * block_size", (hi + 1) * cfg.block_size - 1)
    input_ids = np.fromiter(
        chain.from_iterable((t[1][-1], *t[0]) for t in sizes), dtype=np.int64, count=int(sq.sum())
    )
    total_q = int(sq.sum())
    check_int32("total_q", total_q)
    check_int32("cu_seqlens_k[-1]", int(sk.sum()))
    return HostDecodeBatch(sq, sk, sid, vs, ph, nb, bt_flat, input_ids)


def _params(cfg: MetadataConfig) -> DecodeKernelParams:
    return DecodeKernelParams(
        ca_ratios=cfg.ca_ratios,
        sparse_ratios=cfg.sparse_ratios,
        dense_ratios=cfg.dense_ratios,
        block_size=cfg.block_size,
        window_size=cfg.window_size,
        swa_block_size=cfg.swa_block_size,
        max_num_blocks=cfg.max_num_blocks,
        force_load_balance=cfg.force_load_balance,
    )


def _stacked(keys: tuple[str, ...], q_cap: int, tail: tuple[int, ...], device) -> dict:
    buf = torch.empty((max(len(keys), 1), q_cap, *tail), dtype=torch.int32, device=device)
    return {k: buf[i] for i, k in enumerate(keys)}


def make_decode_device_out(
    config: MetadataConfig, max_num_seqs: int, max_total_q: int, max_seqlen_q: int | None = None
) -> dict:
    """Capture-size buffers for :func:`prepare_decode_on_device` (``out=``) on ``config.device``.

    Per-field tensors have ``max_total_q`` rows; per-ratio dicts hold row views of one stacked
    ``[n_ratio, max_total_q, ...]`` buffer; ``"decode_inputs"`` is the packed input array and
    ``"decode_capacity"`` its :class:`DecodeCapacity`.
    """
    for name, v in (("max_num_seqs", max_num_seqs), ("max_total_q", max_total_q)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    cap = DecodeCapacity(
        max_num_seqs,
        max_total_q,
        max_num_seqs * config.max_num_blocks,
        max_total_q if max_seqlen_q is None else max_seqlen_q,
        len(ratio_table(_params(config))),
    )
    dev = config.torch_device
    q = max_total_q
    i32 = dict(dtype=torch.int32, device=dev)
    out = {
        "decode_capacity": cap,
        "decode_inputs": torch.zeros(cap.packed_len(), **i32),
        "positions": torch.empty(q, **i32),
        "valid_token_mask": torch.empty(q, dtype=torch.bool, device=dev),
        "gate_force_random": torch.empty(q, dtype=torch.bool, device=dev),
        "query_indices": torch.empty(q, **i32),
        "context_lens": torch.empty(q, **i32),
        "slot_mapping_store_swa": torch.empty(q, **i32),
        "state_block_idx": torch.empty(q, **i32),
        "kv_swa_index_offset_len": torch.empty(q, 2, **i32),
        "block_tables": torch.empty(q, config.max_num_blocks, **i32),
        "positions_c": _stacked(tuple(map(ratio_key, config.ca_ratios)), q, (), dev),
        "slot_mapping_store_ca": _stacked(tuple(map(ratio_key, config.ca_ratios)), q, (), dev),
        "klen": _stacked(tuple(map(ratio_key, config.sparse_ratios)), q, (), dev),
        "kv_ca_index_offset_len": _stacked(
            tuple(map(ratio_key, config.dense_ratios)), q, (2,), dev
        ),
    }
    if config.max_ngram_size > 0:
        out["ngram_token_ids"] = torch.empty(q, config.max_ngram_size, **i32)
    return out


_SCALAR_FIELDS = (
    ("positions", torch.int32, ()),
    ("valid_token_mask", torch.bool, ()),
    ("gate_force_random", torch.bool, ()),
    ("query_indices", torch.int32, ()),
    ("context_lens", torch.int32, ()),
    ("slot_mapping_store_swa", torch.int32, ()),
    ("state_block_idx", torch.int32, ()),
    ("kv_swa_index_offset_len", torch.int32, (2,)),
)


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
    field: str, rows: dict, keys: tuple[str, ...], total_q: int, tail: tuple, device
) -> torch.Tensor:
    """The ``[n_ratio, q_stride, *tail]`` view whose rows are ``rows[k]`` for ``k`` in ``keys``.

    Every row must be an int32 tensor of the same shape ``[q_stride >= total_q, *tail]`` and
    strides, all in ONE storage at equally spaced offsets (the stacked buffer of
    :func:`make_decode_device_out`); otherwise ``ValueError``: the kernel writes every ratio
    through this single view, so separate tensors would silently miss its writes.
    """
    if not keys:
        return torch.empty((0, 1, *tail), dtype=torch.int32, device=device)
    if not isinstance(rows, dict) or set(keys) - set(rows):
        raise ValueError(f"out[{field!r}] must be a dict holding keys {list(keys)}")
    ts = [rows[k] for k in keys]
    for k, t in zip(keys, ts):
        _check_buffer(f"{field}[{k!r}]", t, torch.int32, total_q, tail, device)
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
class StagedDecode:
    """What :func:`stage_decode_on_device` hands to :func:`launch_decode_kernels`."""

    meta: InputMetadata
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    block_tables: torch.Tensor  # [q_stride, max_num_blocks]
    params: DecodeKernelParams


def _sections(cap: DecodeCapacity) -> dict[str, tuple[int, int]]:
    n1, n = cap.num_seqs + 1, cap.num_seqs
    sizes = [("cu_q", n1), ("cu_k", n1), ("bt_off", n1), ("seqlen_q", n), ("seqlen_k", n)]
    sizes += [("state", n), ("placeholder", n), ("valid_start", n)]
    sizes += [("input_ids", cap.total_q), ("bt", cap.num_block_ids), ("ratios", cap.num_ratios)]
    out, off = {}, 0
    for name, size in sizes:
        out[name] = (off, size)
        off += size
    return out


def _pack(hb: HostDecodeBatch, cap: DecodeCapacity, ratios: list[int]) -> np.ndarray:
    """The packed int32 host array (tails of the prefix sums repeat the totals)."""
    packed = np.zeros(cap.packed_len(), dtype=np.int32)
    sec = _sections(cap)
    n = hb.num_seqs
    for name, lengths in (("cu_q", hb.seqlen_q), ("cu_k", hb.seqlen_k), ("bt_off", hb.num_blocks)):
        off, size = sec[name]
        cum = exclusive_cumsum(lengths)
        packed[off : off + n + 1] = cum
        packed[off + n + 1 : off + size] = cum[-1]
    for name, arr in (
        ("seqlen_q", hb.seqlen_q),
        ("seqlen_k", hb.seqlen_k),
        ("state", hb.state_id),
        ("placeholder", hb.is_placeholder),
        ("valid_start", hb.valid_start),
        ("input_ids", hb.input_ids),
        ("bt", hb.bt_flat),
        ("ratios", ratios),
    ):
        off = sec[name][0]
        packed[off : off + len(arr)] = arr
    return packed


def _batch_arrays(hb: HostDecodeBatch) -> BatchArrays:
    """``batch.BatchArrays`` of the decode batch (only for the host-side Engram n-grams)."""
    cu_q = exclusive_cumsum(hb.seqlen_q)
    row_seq = np.repeat(np.arange(hb.num_seqs), hb.seqlen_q)
    row_j = np.arange(hb.total_q) - cu_q[:-1][row_seq]
    q_start = hb.seqlen_k - hb.seqlen_q
    return BatchArrays(
        hb.seqlen_q, hb.seqlen_k, q_start, hb.state_id, hb.is_placeholder, hb.valid_start,
        hb.num_blocks, cu_q, exclusive_cumsum(hb.seqlen_k), hb.bt_flat,
        exclusive_cumsum(hb.num_blocks), row_seq, row_j, q_start[row_seq] + row_j,
    )  # fmt: skip


def stage_decode_on_device(
    seqs: Sequence[SequenceMetadata], config: MetadataConfig, *, out: dict | None = None
) -> StagedDecode:
    """Host half: validate, extract, pack, copy to the device, set up the metadata views.

    With ``out`` (from :func:`make_decode_device_out`) every buffer is checked (capacity,
    shape, dtype, device, stacked row views) before anything is written; the step then writes
    prefixes of those buffers. Without ``out``, exactly sized buffers are allocated.
    """
    hb = extract_decode_batch(seqs, config)
    n, total_q = hb.num_seqs, hb.total_q
    max_sq = int(hb.seqlen_q.max())
    decode_ca_offset_check(total_q, config)
    dev = config.torch_device
    if out is None:
        out = make_decode_device_out(config, n, total_q, max_sq)
    cap = out.get("decode_capacity")
    if not isinstance(cap, DecodeCapacity):
        raise ValueError("out must come from make_decode_device_out (no 'decode_capacity')")
    for what, need, have in (
        ("sequences", n, cap.num_seqs),
        ("query rows", total_q, cap.total_q),
        ("block ids", len(hb.bt_flat), cap.num_block_ids),
        ("max_seqlen_q", max_sq, cap.max_seqlen_q),
    ):
        if need > have:
            raise ValueError(f"out holds {have} {what}, the step needs {need}")
    _check_buffer("decode_inputs", out["decode_inputs"], torch.int32, cap.packed_len(), (), dev)
    for name, dtype, tail in _SCALAR_FIELDS:
        _check_buffer(name, out.get(name), dtype, total_q, tail, dev)
    _check_buffer("block_tables", out.get("block_tables"), torch.int32, total_q,
                  (config.max_num_blocks,), dev)  # fmt: skip
    keys = {
        "ca": tuple(map(ratio_key, config.ca_ratios)),
        "sparse": tuple(map(ratio_key, config.sparse_ratios)),
        "dense": tuple(map(ratio_key, config.dense_ratios)),
    }
    stacks = {
        f: stack_rows(f, out.get(f), keys[kind], total_q, tail, dev)
        for f, kind, tail in (
            ("positions_c", "ca", ()),
            ("slot_mapping_store_ca", "ca", ()),
            ("klen", "sparse", ()),
            ("kv_ca_index_offset_len", "dense", (2,)),
        )
    }
    ngram = None
    if config.max_ngram_size > 0:
        from kvplan.plan.base_fields import ngram_token_ids

        _check_buffer("ngram_token_ids", out.get("ngram_token_ids"), torch.int32, total_q,
                      (config.max_ngram_size,), dev)  # fmt: skip
        ngram = ngram_token_ids(seqs, _batch_arrays(hb), config)

    # ---- all checks passed: write
    cuda = dev.type == "cuda"
    prm = _params(config)
    src = torch.from_numpy(_pack(hb, cap, ratio_table(prm)))
    packed = out["decode_inputs"][: cap.packed_len()]
    packed.copy_(src.pin_memory() if cuda else src, non_blocking=cuda)
    sec = {k: packed[o : o + s] for k, (o, s) in _sections(cap).items()}
    meta = InputMetadata(is_prompt=False, num_seqs=n, total_q=total_q, max_seqlen_q=max_sq,
                         max_seqlen_k=int(hb.seqlen_k.max()))  # fmt: skip
    meta.cu_seqlens_q = sec["cu_q"][: n + 1]
    meta.cu_seqlens_k = sec["cu_k"][: n + 1]
    meta.seqlens_q = sec["seqlen_q"][:n]
    meta.seqlens_k = sec["seqlen_k"][:n]
    meta.input_ids = sec["input_ids"][:total_q]
    if ngram is not None:
        buf = out["ngram_token_ids"][:total_q]
        host = torch.from_numpy(np.ascontiguousarray(ngram, dtype=np.int32))
        buf.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        meta.ngram_token_ids = buf
    for name, _, _ in _SCALAR_FIELDS:
        setattr(meta, name, out[name][:total_q])
    meta.block_tables = out["block_tables"][:total_q]
    for f, stack in stacks.items():
        kind = {"positions_c": "ca", "slot_mapping_store_ca": "ca"}.get(f)
        kind = kind or ("sparse" if f == "klen" else "dense")
        setattr(meta, f, {k: stack[i, :total_q] for i, k in enumerate(keys[kind])})
    inputs = DecodeKernelInputs(
        cu_seqlens_q=sec["cu_q"], seqlens_k=sec["seqlen_k"], state_ids=sec["state"],
        is_placeholder=sec["placeholder"], swa_valid_start=sec["valid_start"],
        block_tables_in=sec["bt"], block_tables_offsets=sec["bt_off"], ratios=sec["ratios"],
        max_seqlen_q=cap.max_seqlen_q,
    )  # fmt: skip
    outputs = DecodeKernelOutputs(
        *(out[name] for name, _, _ in _SCALAR_FIELDS),
        positions_c=stacks["positions_c"],
        slot_mapping_store_ca=stacks["slot_mapping_store_ca"],
        klen=stacks["klen"],
        kv_ca_index_offset_len=stacks["kv_ca_index_offset_len"],
    )
    return StagedDecode(meta, inputs, outputs, out["block_tables"], prm)


def launch_decode_kernels(staged: StagedDecode, backend: str = "auto") -> None:
    """Device half: the metadata kernel and the block-table expansion (graph-capturable).

    ``backend``: ``"auto"`` (CUDA -> Triton, CPU -> torch), ``"triton"`` (also on CPU under
    ``TRITON_INTERPRET=1``) or ``"torch"``.
    """
    inp, outp, prm = staged.inputs, staged.outputs, staged.params
    if backend == "auto":
        decode_metadata(inp, outp, prm)
        expand_block_tables(inp, staged.block_tables, prm.max_num_blocks)
    elif backend == "triton":
        decode_metadata_triton(inp, outp, prm)
        expand_block_tables_triton(inp, staged.block_tables, prm.max_num_blocks)
    elif backend == "torch":
        decode_metadata_torch(inp, outp, prm)
        expand_block_tables_torch(inp, staged.block_tables, prm.max_num_blocks)
    else:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def prepare_decode_on_device(
    seqs: Sequence[SequenceMetadata],
    config: MetadataConfig,
    *,
    out: dict | None = None,
    backend: str = "auto",
) -> InputMetadata:
    """Decode metadata built on the device: O(n_seq) host work + two kernel launches.

    Same fields and values as :func:`kvplan.plan.decode.prepare_decode` (``block_tables``
    columns past a row's blocks are unwritten in both). Per-ratio dict entries are row views
    of stacked ``[n_ratio, q_stride, ...]`` buffers.

    Args:
        seqs: the decode batch (``seqlen_q = 1 + len(draft_tokens)`` each).
        config: engine constants; tensors land on ``config.device``.
        out: capture-size buffers from :func:`make_decode_device_out` (checked, then their
            prefixes are written in place); ``None`` allocates exactly sized buffers.
        backend: see :func:`launch_decode_kernels`.

    Raises:
        ValueError / TypeError naming the field and value, before anything is written.
    """
    staged = stage_decode_on_device(seqs, config, out=out)
    launch_decode_kernels(staged, backend)
    return staged.meta
