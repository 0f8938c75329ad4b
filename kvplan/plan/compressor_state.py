"""Compressor state across steps: the pooling windows of compressed KV that straddle chunks.

A compressed entry ``j`` of ratio ``r`` pools a window of raw rows that closes at position
``(j + 1) * r - 1``. Non-overlapping windows (HCA) cover ``[j*r, (j+1)*r)``; overlapping ones
(CSA) cover ``[(j-1)*r, (j+1)*r)``: the first ``r`` rows read the "Ca" half of the previous
window's projections, the last ``r`` the "Cb" half of this window's. A chunked prefill can end
inside a window, so the per-row projections of the last ``R`` positions (``R = r``, or ``2r``
with overlap) are kept per state slot in a small ring::

    ring of R rows (state_id):  row  state_id * R + x % R  holds raw position x

A step over positions ``[q_start, seqlen_k)`` then closes the entries ``j = q_start // r ..
seqlen_k // r - 1`` (the rows ``p`` with ``(p + 1) % r == 0``) and each window row comes from
one of three places, in position order::

    window positions  [first ............................................ (j+1)*r)
                      | empty (x < 0) | ring (0 <= x < q_start) | this step's rows |
    columns           0        n_empty     n_empty + n_ring                      R

``first = (j + 1) * r - R``. The host writes four ints per entry (``window_facts``); the
device expands them into ``[E, R]`` source indices (:func:`expand_window_index`). The ring is
read before this step writes it (``slot_mapping_store_state``: the chunk's last ``R`` rows), as
the SWA ring is.

:func:`plan_compressor_state` is the vectorized builder; :func:`reference_compressor_state`
the per-token loop it equals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvplan._checks import check_int32, check_tensor
from kvplan._math import exclusive_cumsum
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.plan.sequence import SequenceMetadata


def state_rows(ratio: int, overlap: bool) -> int:
    """Rows ``R`` of a state slot's ring: ``2 * ratio`` with overlapping windows, else
    ``ratio`` (also the number of rows each window pools)."""
    return 2 * ratio if overlap else ratio


@dataclass(frozen=True)
class CompressorStatePlan:
    """The compressor-state facts of one step for one ``(ratio, overlap)`` (host numpy).

    Attributes:
        ratio: compression ratio ``r``.
        overlap: windows of ``2r`` rows (CSA) instead of ``r`` (HCA).
        slot_mapping_store_state: int32 ``[T]``, ring row ``state_id * R + p % R`` for the
            chunk's last ``R`` rows, ``-1`` otherwise (and for placeholder rows).
        entry_seq: int64 ``[E]``, the sequence (batch index) of each closing entry.
        entry_index: int64 ``[E]``, ``j`` of each entry; entries are ordered by sequence,
            then ``j``.
        window_facts: int32 ``[E, 4]``: ``(ring_start, n_empty, n_ring, step_start)``; the
            ring part reads rows ``state_id * R + (x % R)`` from ``ring_start = state_id * R +
            max(first, 0) % R`` on, the step part reads step rows from ``step_start``.
    """

    ratio: int
    overlap: bool
    slot_mapping_store_state: np.ndarray
    entry_seq: np.ndarray
    entry_index: np.ndarray
    window_facts: np.ndarray

    @property
    def state_rows(self) -> int:
        return state_rows(self.ratio, self.overlap)

    @property
    def num_entries(self) -> int:
        return int(self.entry_index.shape[0])

    @property
    def positions(self) -> np.ndarray:
        """int64 ``[E]``: the RoPE position ``j * r`` of each entry."""
        return self.entry_index * self.ratio


def _seq_arrays(seqs: Sequence[SequenceMetadata]) -> tuple:
    sq = np.array([s.seqlen_q for s in seqs], dtype=np.int64)
    sk = np.array([s.seqlen_k for s in seqs], dtype=np.int64)
    sid = np.array([s.state_id for s in seqs], dtype=np.int64)
    ph = np.array([bool(s.is_placeholder) for s in seqs], dtype=bool)
    if len(seqs) and ((sq < 1).any() or (sk < sq).any() or (sid < 0).any()):
        i = int(np.flatnonzero((sq < 1) | (sk < sq) | (sid < 0))[0])
        raise ValueError(
            f"seqs[{i}]: seqlen_q = {sq[i]}, seqlen_k = {sk[i]}, state_id = {sid[i]} "
            "(needs seqlen_q >= 1, seqlen_k >= seqlen_q, state_id >= 0)"
        )
    return sq, sk, sid, ph


def _check_ratio(ratio: int) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be an int >= 1, got {ratio!r}")


def plan_compressor_state(
    seqs: Sequence[SequenceMetadata], ratio: int, overlap: bool
) -> CompressorStatePlan:
    """Vectorized builder (numpy, O(T + E)); see the module docstring for the semantics.

    Args:
        seqs: the step's sequences (rows back to back in batch order, as ``InputMetadata``).
        ratio: compression ratio ``r``.
        overlap: ``True`` for CSA's overlapping windows of ``2r`` rows.

    Example (``r = 4``, overlap, one sequence with ``q_start = 6``, ``seqlen_q = 6``,
    ``state_id = 1``, ``R = 8``): rows at positions 6..11 close entries ``j = 1`` (window
    ``[0, 8)``: 6 ring rows 8..13, then step rows 0..1) and ``j = 2`` (window ``[4, 12)``:
    ring rows 12..13, step rows 0..5)::

        window_facts = [[8, 0, 6, 0], [12, 0, 2, 0]]
        slot_mapping_store_state = [14, 15, 8, 9, 10, 11]
    """
    _check_ratio(ratio)
    return _plan_arrays(*_seq_arrays(seqs), ratio, overlap)


def _plan_arrays(
    sq: np.ndarray, sk: np.ndarray, sid: np.ndarray, ph: np.ndarray, ratio: int, overlap: bool
) -> CompressorStatePlan:
    """:func:`plan_compressor_state` from checked int64 ``[n]`` ``seqlen_q``, ``seqlen_k``,
    ``state_id`` and bool ``is_placeholder`` arrays."""
    big_r = state_rows(ratio, overlap)
    q_start = sk - sq
    cu_q = exclusive_cumsum(sq)
    total_q = int(cu_q[-1])
    check_int32("num_state_slots * R", int(sid.max(initial=0) + 1) * big_r)
    row_seq = np.repeat(np.arange(len(sq)), sq)
    pos = np.arange(total_q) - cu_q[:-1][row_seq] + q_start[row_seq]
    keep = (sk[row_seq] - pos <= big_r) & ~ph[row_seq]
    slot = np.where(keep, sid[row_seq] * big_r + pos % big_r, -1).astype(np.int32)

    count = np.where(ph, 0, sk // ratio - q_start // ratio)
    entry_seq = np.repeat(np.arange(len(sq)), count)
    cu_e = exclusive_cumsum(count)
    entry_index = np.arange(int(cu_e[-1])) - cu_e[:-1][entry_seq] + (q_start // ratio)[entry_seq]
    first = (entry_index + 1) * ratio - big_r
    qs = q_start[entry_seq]
    lo = np.maximum(first, 0)
    facts = np.empty((len(entry_index), 4), dtype=np.int64)
    facts[:, 0] = sid[entry_seq] * big_r + lo % big_r
    facts[:, 1] = lo - first
    facts[:, 2] = np.maximum(qs - lo, 0)
    facts[:, 3] = cu_q[:-1][entry_seq] + np.maximum(first, qs) - qs
    check_int32("total_q", total_q)
    return CompressorStatePlan(
        ratio=ratio,
        overlap=overlap,
        slot_mapping_store_state=slot,
        entry_seq=entry_seq.astype(np.int64),
        entry_index=entry_index.astype(np.int64),
        window_facts=facts.astype(np.int32),
    )


def plan_decode_compressor_state(
    q_start: np.ndarray,
    state_id: np.ndarray,
    is_placeholder: np.ndarray,
    ratio: int,
    overlap: bool,
) -> CompressorStatePlan:
    """:func:`plan_compressor_state` of a decode step, one row per sequence (``seqlen_q = 1``),
    from int64 ``[n]`` arrays (``q_start >= 0``, ``state_id >= 0``): no per-sequence Python
    objects. Row ``t`` at position ``p = q_start[t]`` stores ring row ``state_id * R + p % R``
    and closes entry ``j = p // r`` when ``(p + 1) % r == 0`` (placeholder rows: neither)."""
    _check_ratio(ratio)
    ones = np.ones(len(q_start), dtype=np.int64)
    return _plan_arrays(ones, q_start + 1, state_id, np.asarray(is_placeholder, dtype=bool),
                        ratio, overlap)  # fmt: skip


def expand_window_index(
    window_facts: torch.Tensor, num_rows: int, ring_rows: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Expand ``window_facts`` into per-row sources: one Triton kernel on CUDA
    (:func:`expand_window_index_triton`), torch ops elsewhere (:func:`expand_window_index_torch`);
    the same values.

    Args:
        window_facts: int32 / int64 ``[E, 4]`` from :class:`CompressorStatePlan` (any strides).
        num_rows: ``R``, the window length and the ring length per state slot.
        ring_rows: rows of the whole ring tensor (``num_state_slots * R``); step rows are
            numbered after them.
        dtype: int32 or int64, of the result.

    Returns:
        ``[E, R]``: ``-1`` for an empty row (before position 0), a ring row ``< ring_rows``,
        or ``ring_rows + t`` for row ``t`` of this step (``[ring | step]`` index space).
    """
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if use_triton(window_facts):
        return expand_window_index_triton(window_facts, num_rows, ring_rows, dtype)
    return expand_window_index_torch(window_facts, num_rows, ring_rows).to(dtype)


def expand_window_index_torch(
    window_facts: torch.Tensor, num_rows: int, ring_rows: int
) -> torch.Tensor:
    """:func:`expand_window_index` in torch ops (int32), the reference of the kernel."""
    facts = window_facts.to(torch.int64)
    col = torch.arange(num_rows, device=facts.device)[None, :]
    start, n_empty, n_ring, step = (facts[:, i : i + 1] for i in range(4))
    first = start % num_rows
    ring = start - first + (first + col - n_empty) % num_rows
    stepped = ring_rows + step + col - n_empty - n_ring
    out = torch.where(col < n_empty, -1, torch.where(col < n_empty + n_ring, ring, stepped))
    return out.to(torch.int32)


@jit
def _floor_mod(a, m):
    """``a`` modulo ``m > 0`` rounded toward minus infinity (torch's ``%``)."""
    r = a % m
    return tl.where(r < 0, r + m, r)


# ring rows of one state slot x entries a program of `_expand_window_index_kernel` writes
EXPAND_TILE = 1024


@jit(sizes=("num_entries",))
def _expand_window_index_kernel(
    facts_ptr, out_ptr, num_entries, stride_e, stride_f, ring_rows,
    NUM_ROWS: tl.constexpr, R_P2: tl.constexpr, TILE_E: tl.constexpr,
):  # fmt: skip
    """The ring positions wrap in int32 modulo the constexpr ``NUM_ROWS`` (a multiply and a
    shift; an int64 ``%`` by a runtime value is a subroutine call per element, ~20 us for a
    decode step's 32 x 128 entries on the H200); ``start < ring_rows < 2**31`` and the
    window offsets are below ``2 * NUM_ROWS``. The step rows' index stays int64."""
    e = tl.program_id(0) * TILE_E + tl.arange(0, TILE_E)
    e_ok = e < num_entries
    col = tl.arange(0, R_P2)[None, :]
    base = facts_ptr + e.to(tl.int64) * stride_e
    start = tl.load(base, mask=e_ok, other=0).to(tl.int32)[:, None]
    n_empty = tl.load(base + stride_f, mask=e_ok, other=0).to(tl.int32)[:, None]
    n_ring = tl.load(base + 2 * stride_f, mask=e_ok, other=0).to(tl.int32)[:, None]
    step = tl.load(base + 3 * stride_f, mask=e_ok, other=0).to(tl.int64)[:, None]
    first = _floor_mod(start, NUM_ROWS)
    ring = start - first + _floor_mod(first + col - n_empty, NUM_ROWS)
    stepped = ring_rows + step + (col - n_empty - n_ring).to(tl.int64)
    out = tl.where(col < n_empty, -1, tl.where(col < n_empty + n_ring, ring.to(tl.int64), stepped))
    ptrs = out_ptr + e.to(tl.int64)[:, None] * NUM_ROWS + col
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=e_ok[:, None] & (col < NUM_ROWS))


def expand_window_index_triton(
    window_facts: torch.Tensor, num_rows: int, ring_rows: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """:func:`expand_window_index` as one launch (graph-capturable: no host sync)."""
    check_tensor("window_facts", window_facts, dtype=(torch.int32, torch.int64), ndim=2)
    if window_facts.shape[1] != 4:
        raise ValueError(f"window_facts must be [E, 4], got {tuple(window_facts.shape)}")
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    check_int32("ring_rows", ring_rows)
    e = window_facts.shape[0]
    out = torch.empty(e, num_rows, dtype=dtype, device=window_facts.device)
    if e == 0:
        return out
    r_p2 = triton.next_power_of_2(num_rows)
    tile_e = max(1, EXPAND_TILE // r_p2)  # not from e: a new entry count reuses the kernel
    _expand_window_index_kernel[(triton.cdiv(e, tile_e),)](
        window_facts, out, e, window_facts.stride(0), window_facts.stride(1), ring_rows,
        NUM_ROWS=num_rows, R_P2=r_p2, TILE_E=tile_e,
    )  # fmt: skip
    return out


def reference_compressor_state(
    seqs: Sequence[SequenceMetadata], ratio: int, overlap: bool, ring_rows: int
) -> dict:
    """Per-token reference: every field of :func:`plan_compressor_state` plus the expanded
    ``window_index`` (as :func:`expand_window_index` with ``ring_rows``), one row at a time."""
    big_r = state_rows(ratio, overlap)
    store, entry_seq, entry_index, window_index = [], [], [], []
    row0 = 0
    for i, s in enumerate(seqs):
        q_start = s.seqlen_k - s.seqlen_q
        for p in range(q_start, s.seqlen_k):
            ok = not s.is_placeholder and s.seqlen_k - p <= big_r
            store.append(s.state_id * big_r + p % big_r if ok else -1)
            if s.is_placeholder or (p + 1) % ratio:
                continue
            j = (p + 1) // ratio - 1
            entry_seq.append(i)
            entry_index.append(j)
            row = []
            for x in range((j + 1) * ratio - big_r, (j + 1) * ratio):
                if x < 0:
                    row.append(-1)
                elif x < q_start:
                    row.append(s.state_id * big_r + x % big_r)
                else:
                    row.append(ring_rows + row0 + x - q_start)
            window_index.append(row)
        row0 += s.seqlen_q
    return {
        "slot_mapping_store_state": np.array(store, dtype=np.int64),
        "entry_seq": np.array(entry_seq, dtype=np.int64),
        "entry_index": np.array(entry_index, dtype=np.int64),
        "window_index": np.array(window_index, dtype=np.int64).reshape(-1, big_r),
    }
