"""Batch extraction (O(n_seq) host work), input validation and the ``out=`` emitter.

The vectorized builders (``prompt.py``, ``decode.py``) and the on-device decode path start from
:func:`extract_batch`, which validates every sequence (``ValueError`` naming the sequence, the
field and the value, before anything is written) and gathers per-sequence facts into numpy
arrays. :class:`Emitter` turns the computed numpy arrays into tensors: freshly allocated (pinned
and copied ``non_blocking`` when the target device is CUDA), or written into the prefixes of
capture-size ``out=`` buffers after every buffer's shape and dtype was checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvplan._checks import INT32_MAX, check_int32
from kvplan._math import exclusive_cumsum
from kvplan.plan.config import MetadataConfig
from kvplan.plan.sequence import SequenceMetadata


@dataclass
class BatchArrays:
    """Per-sequence facts (numpy int64 ``[n]`` unless noted) and the row -> sequence map.

    ``bt_flat`` concatenates every sequence's first ``num_blocks[i]`` block ids (at the
    smallest ratio; int32 from ``extract_batch``); sequence ``i``'s table starts at
    ``bt_off[i]``. ``row_seq``, ``row_j``,
    ``row_pos`` are ``[total_q]``: owning sequence, local query index, absolute position.
    """

    seqlen_q: np.ndarray
    seqlen_k: np.ndarray
    q_start: np.ndarray
    state_id: np.ndarray
    is_placeholder: np.ndarray  # bool [n]
    valid_start: np.ndarray
    num_blocks: np.ndarray
    cu_q: np.ndarray  # [n + 1]
    cu_k: np.ndarray  # [n + 1]
    bt_flat: np.ndarray
    bt_off: np.ndarray  # [n + 1]
    row_seq: np.ndarray
    row_j: np.ndarray
    row_pos: np.ndarray

    @property
    def num_seqs(self) -> int:
        return len(self.seqlen_q)

    @property
    def total_q(self) -> int:
        return int(self.cu_q[-1])


def _bad(i: int, field: str, value: object, why: str) -> ValueError:
    return ValueError(f"seqs[{i}].{field} = {value!r}: {why}")


def validate_sequence(i: int, s: SequenceMetadata, cfg: MetadataConfig, is_prompt: bool) -> None:
    """Per-sequence checks (everything but the block-id range, checked in bulk)."""
    sq, sk = s.seqlen_q, s.seqlen_k
    if isinstance(sq, bool) or not isinstance(sq, int | np.integer) or sq < 1:
        raise _bad(i, "seqlen_q", sq, "must be an int >= 1")
    if isinstance(sk, bool) or not isinstance(sk, int | np.integer) or sk < sq:
        raise _bad(i, "seqlen_k", sk, f"must be an int >= seqlen_q = {sq}")
    if sk > cfg.max_model_len:
        raise _bad(i, "seqlen_k", sk, f"exceeds max_model_len = {cfg.max_model_len}")
    n_draft = len(s.draft_tokens)
    if is_prompt:
        if n_draft:
            raise _bad(i, "draft_tokens", list(s.draft_tokens), "draft tokens on a prompt")
        if len(s.token_ids) < sk:
            raise _bad(i, "token_ids", f"<{len(s.token_ids)} ids>", f"needs >= seqlen_k = {sk}")
    else:
        if sq != 1 + n_draft:
            raise _bad(i, "seqlen_q", sq, f"decode needs 1 + len(draft_tokens) = {1 + n_draft}")
        if len(s.token_ids) != sk - sq + 1:
            raise _bad(
                i, "token_ids", f"<{len(s.token_ids)} ids>", f"decode needs {sk - sq + 1} ids"
            )
        if sq - 1 + cfg.window_size > cfg.swa_block_size:
            raise _bad(
                i,
                "seqlen_q",
                sq,
                f"window_size {cfg.window_size} + {sq - 1} drafts do not fit the SWA ring "
                f"(swa_block_size = {cfg.swa_block_size})",
            )
    vs = s.swa_valid_start
    if isinstance(vs, bool) or not isinstance(vs, int | np.integer) or not 0 <= vs <= sk - sq:
        raise _bad(i, "swa_valid_start", vs, f"must be in [0, q_start = {sk - sq}]")
    sid = s.state_id
    if isinstance(sid, bool) or not isinstance(sid, int | np.integer) or sid < 0:
        raise _bad(i, "state_id", sid, "must be an int >= 0")
    if cfg.num_state_slots is not None and sid >= cfg.num_state_slots:
        raise _bad(i, "state_id", sid, f"out of range [0, {cfg.num_state_slots})")
    if (sid + 1) * cfg.swa_block_size - 1 > INT32_MAX:
        raise _bad(i, "state_id", sid, "state_id * swa_block_size overflows int32")
    need = cfg.num_blocks_for(sk)
    if len(s.block_table) < need:
        raise _bad(
            i, "block_table", f"<{len(s.block_table)} blocks>", f"seqlen_k = {sk} needs {need}"
        )


def _ints(values: list) -> np.ndarray | None:
    """``values`` as int64, or ``None`` when any entry is not an integer (slow path names it)."""
    arr = np.asarray(values)
    return arr.astype(np.int64, copy=False) if arr.dtype.kind in "iu" else None


def extract_batch(
    seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: bool
) -> BatchArrays:
    """Validate ``seqs`` and gather their facts.

    The checks of :func:`validate_sequence` run vectorized over the batch; only when one fails
    does the per-sequence loop run, to raise with the exact sequence, field and value.
    Row arrays (``row_seq``, ``row_j``, ``row_pos``) are int32 (``total_q`` is checked).
    """
    if not isinstance(cfg, MetadataConfig):
        raise TypeError(f"config must be a MetadataConfig, got {type(cfg).__name__}")
    n = len(seqs)
    if n == 0:
        raise ValueError("seqs is empty: a step needs at least one sequence")
    for i, s in enumerate(seqs):
        if not isinstance(s, SequenceMetadata):
            raise TypeError(f"seqs[{i}] must be a SequenceMetadata, got {type(s).__name__}")
    sq = _ints([s.seqlen_q for s in seqs])
    sk = _ints([s.seqlen_k for s in seqs])
    sid = _ints([s.state_id for s in seqs])
    vs = _ints([s.swa_valid_start for s in seqs])
    ph = np.array([bool(s.is_placeholder) for s in seqs])
    n_tok = np.array([len(s.token_ids) for s in seqs])
    n_draft = np.array([len(s.draft_tokens) for s in seqs])
    n_bt = np.array([len(s.block_table) for s in seqs])
    ok = sq is not None and sk is not None and sid is not None and vs is not None
    if ok:
        nb = cfg.num_blocks_for(sk)
        ok = bool(
            (sq >= 1).all()
            and (sk >= sq).all()
            and (sk <= cfg.max_model_len).all()
            and (vs >= 0).all()
            and (vs <= sk - sq).all()
            and (sid >= 0).all()
            and ((sid + 1) * cfg.swa_block_size - 1 <= INT32_MAX).all()
            and (cfg.num_state_slots is None or (sid < cfg.num_state_slots).all())
            and (n_bt >= nb).all()
        )
        if is_prompt:
            ok = ok and not n_draft.any() and bool((n_tok >= sk).all())
        else:
            ok = ok and bool(
                (sq == 1 + n_draft).all()
                and (n_tok == sk - sq + 1).all()
                and (sq - 1 + cfg.window_size <= cfg.swa_block_size).all()
            )
    if not ok:
        for i, s in enumerate(seqs):  # raises with the exact sequence, field and value
            validate_sequence(i, s, cfg, is_prompt)
        raise AssertionError("vectorized checks disagree with validate_sequence")
    tables = [
        t if len(t) == k else t[:k] for t, k in zip([s.block_table for s in seqs], nb.tolist())
    ]
    # Empty tables are dropped first: np.concatenate would promote them to float64.
    nonempty = [t for t in tables if len(t)]
    bt_flat = np.concatenate(nonempty) if nonempty else np.zeros(0, dtype=np.int64)
    if bt_flat.dtype.kind not in "iu" and len(bt_flat):
        raise TypeError(f"block_table entries must be integers, got dtype {bt_flat.dtype}")
    bt_flat = bt_flat.astype(np.int64, copy=False)
    bt_off = exclusive_cumsum(nb)
    if len(bt_flat):
        lo, hi = int(bt_flat.min()), int(bt_flat.max())
        if lo < 0:
            i = int(np.searchsorted(bt_off, np.flatnonzero(bt_flat < 0)[0], side="right")) - 1
            raise _bad(i, "block_table", lo, "holds a negative block id")
        if cfg.num_kv_blocks is not None and hi >= cfg.num_kv_blocks:
            i = int(np.searchsorted(bt_off, np.flatnonzero(bt_flat == hi)[0], side="right")) - 1
            raise _bad(i, "block_table", hi, f"block id out of range [0, {cfg.num_kv_blocks})")
        check_int32("block id * block_size", (hi + 1) * cfg.block_size - 1)
    bt_flat = bt_flat.astype(np.int32)  # checked: every slot derived from it fits int32
    cu_q = exclusive_cumsum(sq)
    total_q = int(cu_q[-1])
    check_int32("total_q", total_q)
    cu_k = exclusive_cumsum(sk)
    check_int32("cu_seqlens_k[-1]", int(cu_k[-1]))
    q_start = sk - sq
    row_seq = np.repeat(np.arange(n, dtype=np.int32), sq)
    arange = np.arange(total_q, dtype=np.int32)
    row_j = arange - np.repeat(cu_q[:-1].astype(np.int32), sq)
    row_pos = arange + np.repeat((q_start - cu_q[:-1]).astype(np.int32), sq)
    return BatchArrays(
        seqlen_q=sq,
        seqlen_k=sk,
        q_start=q_start,
        state_id=sid,
        is_placeholder=ph,
        valid_start=vs,
        num_blocks=nb,
        cu_q=cu_q,
        cu_k=cu_k,
        bt_flat=bt_flat,
        bt_off=bt_off,
        row_seq=row_seq,
        row_j=row_j,
        row_pos=row_pos,
    )


_NP_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}


def lookup_out_buffer(out: dict, field: str, key: str | None, label: str) -> torch.Tensor:
    """``out[field]`` (``out[field][key]`` for a per-ratio field), checked to be a tensor.

    ``label`` names the buffer in the ``TypeError``.
    """
    if field not in out:
        raise ValueError(f"out is missing field {field!r}")
    buf = out[field]
    if key is not None:
        if not isinstance(buf, dict) or key not in buf:
            raise ValueError(f"out[{field!r}] must be a dict holding key {key!r}")
        buf = buf[key]
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"out {label} must be a torch.Tensor, got {type(buf).__name__}")
    return buf


class Emitter:
    """Collects ``(field, key, numpy array, dtype)`` and writes them as tensors in one pass.

    ``finish(meta)`` first checks every ``out`` buffer (``out[field]`` or ``out[field][key]``:
    a tensor on ``device`` with the same dtype and trailing shape and at least as many rows),
    then writes. With ``out`` the field becomes the prefix view ``buf[:rows]`` of the buffer
    (CUDA-graph safe: same storage every step); without it a new tensor is allocated, pinned
    and copied ``non_blocking`` when ``device`` is CUDA (the pinned source is private to that
    copy). A 2-D array added with ``width`` larger than its own is a field of that width whose
    columns past the array's are left unwritten (``block_tables``).
    """

    def __init__(self, device: torch.device, out: dict | None) -> None:
        self.device = device
        self.out = out
        self.items: list[tuple[str, str | None, np.ndarray, torch.dtype, tuple]] = []

    def add(
        self,
        field: str,
        arr: np.ndarray,
        dtype: torch.dtype,
        key: str | None = None,
        width: int | None = None,
    ) -> None:
        shape = tuple(arr.shape) if width is None else (arr.shape[0], width)
        self.items.append((field, key, arr, dtype, shape))

    def _buffer(self, field: str, key: str | None, shape: tuple, dtype: torch.dtype):
        label = field if key is None else f"{field}[{key!r}]"
        buf = lookup_out_buffer(self.out, field, key, label)
        if buf.dtype != dtype:
            raise TypeError(f"out {label} must have dtype {dtype}, got {buf.dtype}")
        if tuple(buf.shape[1:]) != shape[1:] or buf.shape[0] < shape[0]:
            raise ValueError(
                f"out {label} has shape {tuple(buf.shape)}; needs [>= {shape[0]}"
                f"{''.join(', ' + str(d) for d in shape[1:])}]"
            )
        if buf.device.type != self.device.type:
            raise ValueError(f"out {label} is on {buf.device}, expected {self.device}")
        return buf

    def finish(self, meta) -> None:
        bufs = [self._buffer(f, k, sh, d) for f, k, _, d, sh in self.items] if self.out else None
        cuda = self.device.type == "cuda"
        for idx, (field, key, arr, dtype, shape) in enumerate(self.items):
            src = np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype])
            cols = (slice(None),) if shape == src.shape else (slice(None), slice(0, src.shape[1]))
            if cuda:
                t = bufs[idx][: shape[0]] if bufs is not None else None
                if t is None:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                t[cols].copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)
            elif bufs is not None:
                t = bufs[idx][: shape[0]]
                t.numpy()[cols] = src  # numpy copy: no intra-op thread pool on the hot path
            elif shape == src.shape:
                t = torch.from_numpy(src)  # CPU metadata: the numpy result itself
            else:
                full = np.empty(shape, dtype=src.dtype)
                full[cols] = src
                t = torch.from_numpy(full)
            if key is None:
                setattr(meta, field, t)
            else:
                getattr(meta, field)[key] = t
