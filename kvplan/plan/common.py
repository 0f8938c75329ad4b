"""Formulas shared by every planning path, each in exactly one place.

Everything here works on Python ints and on numpy int arrays alike (elementwise), so the
vectorized builders, the per-token references and the on-device path use the same definitions.

Glossary: ``q_start = seqlen_k - seqlen_q`` (first query position of a sequence), ``p`` an
absolute query position, ``W`` the window, ``r`` a compression ratio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

IntLike = TypeVar("IntLike", int, np.ndarray)


def compressed_kv_len(seqlen_k: IntLike, ratio: int) -> IntLike:
    """Rows a sequence occupies in the loaded compressed buffer of ``ratio``.

    ``max(1, seqlen_k // ratio)``: the complete compression groups, but at least one row (a
    zero-filled row for a sequence with no complete group), so that ``cu_compressed_seqlens``
    is strictly increasing. The ONE owner of this formula: the compressed load plan
    (``load_segments_ca``), ``cu_compressed_seqlens`` / ``total_k_compressed``, the ``ks``
    base of sparse ratios and the ``kv_ca_index_offset_len`` base of dense ratios all call it.
    """
    if isinstance(seqlen_k, np.ndarray):
        return np.maximum(1, seqlen_k // ratio)
    return max(1, seqlen_k // ratio)


def num_complete_groups(seqlen_k: IntLike, ratio: int) -> IntLike:
    """Compressed tokens that exist after ``seqlen_k`` raw tokens: ``seqlen_k // ratio``.

    Also the number of compressed tokens visible to a query at ``p`` when called with
    ``p + 1`` (DESIGN.md: tokens ``j = 0 .. (p + 1) // r - 1``). Arrays must be non-negative
    (a power-of-two ratio becomes a shift, which equals floor division there).
    """
    if isinstance(seqlen_k, np.ndarray) and ratio & (ratio - 1) == 0:
        return np.right_shift(seqlen_k, ratio.bit_length() - 1)
    return seqlen_k // ratio


def num_new_compressed(seqlen_q: IntLike, seqlen_k: IntLike, ratio: int) -> tuple:
    """``(valid, rows)`` of the compressed tokens a prompt chunk completes.

    ``valid = seqlen_k // r - q_start // r`` groups end inside ``[q_start, seqlen_k)``;
    ``rows = max(1, valid)`` rows of ``positions_c`` / ``slot_mapping_store_ca`` are emitted
    (a filler row ``0 / -1`` keeps every sequence at least one row for the compressor).
    """
    valid = seqlen_k // ratio - (seqlen_k - seqlen_q) // ratio
    rows = np.maximum(1, valid) if isinstance(valid, np.ndarray) else max(1, valid)
    return valid, rows


def completes_group(pos: IntLike, ratio: int):
    """True where raw position ``pos`` is the last token of a compression group."""
    return (pos + 1) % ratio == 0


def paged_slot(block_ids: IntLike, index: IntLike, tokens_per_block: int) -> IntLike:
    """Slot of logical entry ``index`` whose block is ``block_ids`` (= ``table[index // tpb]``).

    ``slot = block * tpb + index % tpb``; the caller has already looked ``block_ids`` up.
    """
    return block_ids * tokens_per_block + index % tokens_per_block


def ring_slot(state_id: IntLike, pos: IntLike, swa_block_size: int) -> IntLike:
    """SWA ring slot of raw position ``pos``: ``state_id * swa_block_size + pos % swa_block_size``."""
    return state_id * swa_block_size + pos % swa_block_size


def swa_stores(seqlen_q: IntLike, j: IntLike, swa_block_size: int):
    """True where local query row ``j`` is among the chunk's last ``swa_block_size`` rows.

    Earlier rows would be overwritten in the ring by later rows of the same chunk, so they get
    slot ``-1`` in ``slot_mapping_store_swa``.
    """
    return seqlen_q - j <= swa_block_size


def swa_visible_lo(pos: IntLike, window_size: int, valid_start: IntLike) -> IntLike:
    """Lowest raw position the sliding window of a query at ``pos`` sees.

    ``clamp(max(pos - W + 1, valid_start), 0, pos + 1)`` (DESIGN.md); the visible keys are
    ``lo .. pos``; ``lo == pos + 1`` would mean none (not reachable for validated input, where
    ``valid_start <= q_start <= pos``; YoCo's extra lower bound can reach it).
    """
    if isinstance(pos, np.ndarray) or isinstance(valid_start, np.ndarray):
        lo = np.maximum(pos - window_size + 1, valid_start)
        return np.minimum(np.maximum(lo, 0), pos + 1)
    return min(max(pos - window_size + 1, valid_start, 0), pos + 1)


def swa_pivots(
    pos: IntLike,
    j: IntLike,
    q_start: IntLike,
    valid_start: IntLike,
    window_size: int,
    sec1_start: IntLike,
    sec2_start: IntLike,
    extra_lo: IntLike | None = None,
) -> tuple:
    """The prompt SWA pivots ``(P0, P1, P2, P3)`` of a query row (see ``prompt.py``).

    The concatenated buffer holds, per sequence, a history section of ``W`` rows for absolute
    positions ``[q_start - W, q_start)`` starting at ``sec1_start``, and the current chunk
    (position ``q_start + k`` at ``sec2_start + k``). The row's visible set ``lo .. pos``
    becomes ``P1`` history rows from ``P0`` and ``P3`` chunk rows from ``P2``::

        history  [q_start-W ............ q_start)   chunk [q_start ...... pos]
                          |-- P1 rows --|                 |-- P3 rows --|
                          P0                              P2

    ``extra_lo`` is one more lower bound (YoCo's rectangle start); ``None`` for none.
    """
    lo = swa_visible_lo(pos, window_size, valid_start)
    if extra_lo is not None:
        lo = np.minimum(np.maximum(lo, extra_lo), pos + 1)
    return tuple(
        swa_pivots_rel(j, lo - q_start, window_size, sec1_start + window_size, sec2_start).T
    )


def swa_pivots_rel(
    j: np.ndarray, lo_rel: np.ndarray, window_size: int, sec1_end: np.ndarray, sec2_start
) -> np.ndarray:
    """The pivots formula, from the lowest visible position relative to ``q_start``.

    ``lo_rel = lo - q_start`` (negative: the window reaches into the history section, which
    ends at buffer row ``sec1_end``). Returns int32 ``[rows, 4]``::

        P1 = max(-lo_rel, 0)        history rows     P0 = sec1_end - P1
        k_lo = max(lo_rel, 0)       first chunk row  P2 = sec2_start + k_lo
        P3 = j + 1 - k_lo           chunk rows (up to and including the query itself)
    """
    j = np.asarray(j)
    out = np.empty((j.shape[0], 4), dtype=np.int32)
    np.maximum(-lo_rel, 0, out=out[:, 1])
    np.subtract(sec1_end, out[:, 1], out=out[:, 0])
    k_lo = np.maximum(lo_rel, 0)
    np.add(sec2_start, k_lo, out=out[:, 2])
    np.subtract(j + 1, k_lo, out=out[:, 3])
    return out


def host_int64(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a host int64 numpy array (a copy)."""
    return t.detach().cpu().numpy().astype(np.int64)
