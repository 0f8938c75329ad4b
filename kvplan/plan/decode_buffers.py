"""Capture-size buffers of the on-device decode step: capacity, allocation, checks, binding.

:func:`make_decode_device_out` allocates, once, every buffer a decode step writes (per-row
fields ``[q_cap, ...]``; per-ratio fields as row views of ONE stacked ``[n_ratio, q_cap, ...]``
buffer each; the packed int32 device inputs). :func:`bind_buffers` checks such a dict against
a config (shapes, dtypes, device; stacked rows sharing one storage at equal spacing with equal
strides) and builds the kernel views once; the result is cached in ``out["_bound"]`` and
re-checked whenever a buffer of the dict is replaced. :func:`write_packed` writes a step's
packed inputs; :func:`meta_views` gives the prefix views a batch of ``n`` sequences /
``total_q`` rows exposes as metadata fields.

Packed device inputs (int32), capacities ``n_cap`` sequences, ``q_cap`` rows, ``b_cap`` ids::

    [cu_q | cu_k | bt_off] 3 x (n_cap + 1)     prefix sums; tails past the batch repeat the
    [seqlen_q | seqlen_k | state | placeholder | valid_start] 5 x n_cap     total, so padded
    [ratio table] [input_ids] q_cap [block ids] b_cap       programs see seqlen_q = 0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import is_

import numpy as np
import torch

from kvplan._math import exclusive_cumsum
from kvplan.plan.config import MetadataConfig, ratio_key
from kvplan.plan.decode_kernels import (
    DecodeKernelInputs,
    DecodeKernelOutputs,
    DecodeKernelParams,
    ratio_table,
)

PER_SEQ_SECTIONS = ("seqlen_q", "seqlen_k", "state", "placeholder", "valid_start")
ROW_FIELDS = (  # name, dtype, trailing shape
    ("positions", torch.int32, ()),
    ("valid_token_mask", torch.bool, ()),
    ("gate_force_random", torch.bool, ()),
    ("query_indices", torch.int32, ()),
    ("context_lens", torch.int32, ()),
    ("slot_mapping_store_swa", torch.int32, ()),
    ("state_block_idx", torch.int32, ()),
    ("kv_swa_index_offset_len", torch.int32, (2,)),
)
RATIO_FIELDS = (  # name, which ratios, trailing shape
    ("positions_c", "ca_ratios", ()),
    ("slot_mapping_store_ca", "ca_ratios", ()),
    ("klen", "sparse_ratios", ()),
    ("kv_ca_index_offset_len", "dense_ratios", (2,)),
)


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
        sizes += [(k, n) for k in PER_SEQ_SECTIONS]
        sizes += [("ratios", self.num_ratios), ("input_ids", self.total_q)]
        sizes += [("bt", self.num_block_ids)]
        offsets = exclusive_cumsum([s for _, s in sizes]).tolist()  # [n + 1]
        return {k: (o, s) for (k, s), o in zip(sizes, offsets)}

    def packed_len(self) -> int:
        return sum(length for _, length in self.sections().values())


def params_from_config(cfg: MetadataConfig) -> DecodeKernelParams:
    """The kernel scalars of ``cfg``."""
    return DecodeKernelParams(
        ca_ratios=cfg.ca_ratios, sparse_ratios=cfg.sparse_ratios, dense_ratios=cfg.dense_ratios,
        block_size=cfg.block_size, window_size=cfg.window_size,
        swa_block_size=cfg.swa_block_size, max_num_blocks=cfg.max_num_blocks,
        force_load_balance=cfg.force_load_balance,
    )  # fmt: skip


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
    for name, dtype, tail in ROW_FIELDS:
        out[name] = torch.empty((q, *tail), dtype=dtype, device=dev)
    out["block_tables"] = torch.empty(q, config.max_num_blocks, dtype=torch.int32, device=dev)
    if config.max_ngram_size > 0:
        out["ngram_token_ids"] = torch.empty(
            q, config.max_ngram_size, dtype=torch.int32, device=dev
        )
    for name, which, tail in RATIO_FIELDS:
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
class BoundBuffers:
    """A checked ``out`` dict: the kernel views, built once (cached in ``out["_bound"]``)."""

    config: MetadataConfig
    cap: DecodeCapacity
    sources: list  # the out entries checked, for identity re-checks
    inputs: DecodeKernelInputs
    outputs: DecodeKernelOutputs
    params: DecodeKernelParams
    ratios: list[int]  # ratio_table(params)
    packed: torch.Tensor  # [packed_len] int32, the device inputs
    sections: dict[str, torch.Tensor]  # name -> view of packed
    offsets: dict[str, tuple[int, int]]  # name -> (offset, length) in packed
    views: dict = field(default_factory=dict)  # (n, total_q) -> meta field views

    def __post_init__(self) -> None:
        # identity-check tables for still_valid: (keys, values) of the tensors, and per dict
        # entry (key, its keys, its values)
        plain = [(k, v) for k, v in self.sources if not isinstance(v, dict)]
        self._keys, self._vals = tuple(k for k, _ in plain), tuple(v for _, v in plain)
        self._dicts = tuple((k, tuple(v), tuple(v.values()))
                            for k, v in self.sources if isinstance(v, dict))  # fmt: skip
        self.ratios_array = np.asarray(self.ratios, dtype=np.int32)

    def still_valid(self, out: dict, config: MetadataConfig) -> bool:
        """True when ``config`` equals the bound one and every checked entry of ``out`` is
        the very object that was checked (identity, so a replaced buffer is checked again)."""
        if not (config is self.config or config == self.config):
            return False
        get = out.get
        if not all(map(is_, map(get, self._keys), self._vals)):
            return False
        for k, keys, vals in self._dicts:
            d = get(k)
            if not isinstance(d, dict) or not all(map(is_, map(d.get, keys), vals)):
                return False
        return True


def bind_buffers(out: dict, config: MetadataConfig) -> BoundBuffers:
    """Check every buffer of ``out`` at its capacity and build the kernel views (cached)."""
    bound = out.get("_bound")
    if isinstance(bound, BoundBuffers) and bound.still_valid(out, config):
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
    names = [n for n, _, _ in ROW_FIELDS] + ["block_tables"]
    for name, dtype, tail in (
        *ROW_FIELDS,
        ("block_tables", torch.int32, (config.max_num_blocks,)),
    ):
        _check_buffer(name, out.get(name), dtype, cap.total_q, tail, dev)
    if config.max_ngram_size > 0:
        names.append("ngram_token_ids")
        _check_buffer("ngram_token_ids", out.get("ngram_token_ids"), torch.int32, cap.total_q,
                      (config.max_ngram_size,), dev)  # fmt: skip
    stacks = {}
    for name, which, tail in RATIO_FIELDS:
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
    outputs = DecodeKernelOutputs(*(out[n] for n, _, _ in ROW_FIELDS), **stacks)
    sources = [(k, out[k]) for k in ["decode_inputs", *names]]
    sources += [(k, dict(out[k])) for k, _, _ in RATIO_FIELDS]
    bound = BoundBuffers(config, cap, sources, inputs, outputs, prm, ratio_table(prm), packed,
                         sec, cap.sections())  # fmt: skip
    out["_bound"] = bound
    return bound


def meta_views(b: BoundBuffers, out: dict, n: int, total_q: int) -> dict:
    """Prefix views of every metadata tensor for a batch of ``n`` sequences / ``total_q`` rows
    (cached per shape: a decode loop cycles through few shapes)."""
    views = b.views.get((n, total_q))
    if views is None:
        sec = b.sections
        views = {"cu_seqlens_q": sec["cu_q"][: n + 1], "cu_seqlens_k": sec["cu_k"][: n + 1],
                 "seqlens_q": sec["seqlen_q"][:n], "seqlens_k": sec["seqlen_k"][:n],
                 "input_ids": sec["input_ids"][:total_q],
                 "block_tables": out["block_tables"][:total_q]}  # fmt: skip
        for name, _, _ in ROW_FIELDS:
            views[name] = out[name][:total_q]
        if "ngram_token_ids" in out and b.config.max_ngram_size > 0:
            views["ngram_token_ids"] = out["ngram_token_ids"][:total_q]
        for name, _, _ in RATIO_FIELDS:
            stack = getattr(b.outputs, name)
            views[name] = {k: stack[i, :total_q] for i, k in enumerate(out[name])}
        if len(b.views) >= 64:  # bounded: a long run may see many (n, total_q) shapes
            b.views.clear()
        b.views[(n, total_q)] = views
    return views


def write_packed(b: BoundBuffers, cus: np.ndarray, facts: np.ndarray, input_ids: np.ndarray,
                 block_ids: np.ndarray) -> None:  # fmt: skip
    """Write a step's packed inputs: only the used prefix (up to the last block id).

    ``cus`` int ``[3, n + 1]`` (exclusive prefix sums of seqlen_q, seqlen_k, num_blocks),
    ``facts`` int ``[5, n]`` (``PER_SEQ_SECTIONS`` order), ``input_ids`` ``[total_q]``,
    ``block_ids`` ``[sum num_blocks]``; every value already checked to fit int32. The
    prefix-sum sections form one ``[3, n_cap + 1]`` block and the per-sequence sections one
    ``[5, n_cap]`` block, each written with one call. CUDA: into a private pinned snapshot,
    then one ``non_blocking`` copy; CPU: straight into the buffer (no copy, no torch intra-op
    thread hand-off on a busy host).
    """
    n, n_cap, sec = facts.shape[1], b.cap.num_seqs, b.offsets
    used = sec["bt"][0] + len(block_ids)
    cuda = b.packed.is_cuda
    host = torch.empty(used, dtype=torch.int32, pin_memory=True) if cuda else None
    h = host.numpy() if cuda else b.packed.numpy()[:used]
    o_cu, o_seq = sec["cu_q"][0], sec["seqlen_q"][0]
    assert o_seq == o_cu + 3 * (n_cap + 1) and sec["valid_start"][0] == o_seq + 4 * n_cap, (
        "packed layout changed"
    )
    block = h[o_cu:o_seq].reshape(3, n_cap + 1)
    block[:, : n + 1] = cus
    block[:, n + 1 :] = cus[:, -1:]  # padded programs: seqlen_q = 0, no blocks
    h[o_seq : o_seq + 5 * n_cap].reshape(5, n_cap)[:, :n] = facts
    h[sec["ratios"][0] : sec["ratios"][0] + len(b.ratios)] = b.ratios_array
    h[sec["input_ids"][0] : sec["input_ids"][0] + len(input_ids)] = input_ids
    h[sec["bt"][0] : used] = block_ids
    if cuda:
        b.packed[:used].copy_(host, non_blocking=True)
