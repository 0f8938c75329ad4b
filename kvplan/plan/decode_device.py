"""``prepare_decode_on_device``: O(n_seq) host extraction + two kernel launches.

Two input forms: a list of ``SequenceMetadata`` (the host reads every object once per
attribute, :func:`kvplan.plan.decode_extract.extract_decode_batch`) or a
:class:`~kvplan.plan.decode_arrays.DecodeBatchArrays` (the same facts as arrays a scheduler
keeps up to date incrementally: a fixed number of numpy calls, no Python walk over the
sequences). Both are validated before anything is written, with errors naming the field and
the value.

The validated facts are packed into ONE int32 array
(:func:`kvplan.plan.decode_buffers.write_packed`: a private pinned snapshot and one
``non_blocking`` copy on CUDA). :mod:`kvplan.plan.decode_kernels` then writes every per-token
field of every ratio and the per-token ``block_tables``. Values equal
:func:`kvplan.plan.decode.prepare_decode` (tests compare field by field).

CUDA graphs: :func:`make_decode_device_out` allocates capture-size buffers once (see
:mod:`kvplan.plan.decode_buffers`); with ``out=`` every step writes their prefixes, so a graph
captured over :func:`launch_decode_kernels` at ``n_cap`` programs replays any smaller batch
staged by :func:`stage_decode_on_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvplan.plan.config import MetadataConfig
from kvplan.plan.decode import decode_ca_offset_check
from kvplan.plan.decode_arrays import DecodeBatchArrays, check_ngram_ids, decode_host_batch
from kvplan.plan.decode_buffers import (
    bind_buffers,
    make_decode_device_out,
    meta_views,
    write_packed,
)
from kvplan.plan.decode_extract import decode_ngram_ids, extract_decode_batch
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
