"""Context-parallel mirror layout of a prompt step (zigzag split of every chunk).

With ``cp_size = p`` ranks, each sequence's chunk of ``seqlen_q = L`` query rows is cut into
``2p`` pieces of ``ps = ceil(L / 2p)`` rows; rank ``r`` computes pieces ``r`` and ``2p-1-r``
(one early piece and one late piece, so causal work is balanced)::

    L = 10, p = 2  ->  ps = 3, pieces  [0 1 2 | 3 4 5 | 6 7 8 | 9 - -]
    rank 0 takes pieces 0 and 3: mirror rows [0 1 2 | 9 -1 -1]
    rank 1 takes pieces 1 and 2: mirror rows [3 4 5 | 6  7  8]

Every rank holds ``cp_mirror_len = sum_s 2 * ps_s`` mirror rows (the same on all ranks), so
the all-gathered buffer is ``[cp_size * cp_mirror_len]``. Rows past the end of a chunk are
padding (``mirror_cp_index == -1``).

Only the chunk (``seqlen_q``) is split, never the history: chunked prefill mirrors each chunk
on its own. Query-aligned fields move with their rows; fields that describe whole sequences
(cu_seqlens, load plans, compressed-KV write slots, ``input_ids``) are kept, and the
pre-mirror ``positions`` / image mask are kept as ``positions_cp`` / ``images_seq_mask_full``
because the compressor works on whole sequences in their original order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvplan._checks import check_int32
from kvplan._math import cdiv, exclusive_cumsum
from kvplan.plan.common import compressed_kv_len
from kvplan.plan.config import QUERY_INDEX_PLACEHOLDER, ratio_key
from kvplan.plan.metadata_fields import Meta, MetadataFields


@dataclass(frozen=True)
class CpMirror:
    """Result of :func:`prepare_cp_mirror` (all tensors int32, CPU).

    - ``mirror_cp_index``: ``[cp_mirror_len]``, global query row of each mirror row, -1 = pad.
    - ``mirror_cp_reverse_index``: ``[total_q]``, for each global query row its row in the
      all-gathered ``[cp_size * cp_mirror_len]`` buffer (``owner * cp_mirror_len + row``).
    - ``ks`` / ``ke``: per ratio key, ``[cp_mirror_len]`` key range of each mirror row in the
      concatenated compressed buffer (pad rows: 0 / 0, an empty range).
    - ``cp_mirror_len``: number of mirror rows on every rank.
    """

    mirror_cp_index: torch.Tensor
    mirror_cp_reverse_index: torch.Tensor
    ks: dict[str, torch.Tensor]
    ke: dict[str, torch.Tensor]
    cp_mirror_len: int


def cp_piece_size(seqlen_q: np.ndarray, cp_size: int) -> np.ndarray:
    """``ceil(seqlen_q / (2 * cp_size))`` per sequence: rows of one zigzag piece."""
    return cdiv(seqlen_q, 2 * cp_size)


def cp_mirror_len(seqlen_q: np.ndarray, cp_size: int) -> int:
    """Mirror rows per rank: ``sum_s 2 * ceil(seqlen_q[s] / (2 * cp_size))``."""
    return int(2 * cp_piece_size(np.asarray(seqlen_q, dtype=np.int64), cp_size).sum())


def _as_np(name: str, t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    if a.ndim != 1 or a.size < 1:
        raise ValueError(f"{name} must be a 1-D prefix sum of length n+1, got shape {a.shape}")
    a = a.astype(np.int64)
    if a[0] != 0 or np.any(np.diff(a) < 0):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {a.tolist()[:8]}")
    return a


def prepare_cp_mirror(
    cu_seqlens_q: torch.Tensor | np.ndarray,
    cu_seqlens_k: torch.Tensor | np.ndarray,
    cp_size: int,
    cp_rank: int,
    ratios: tuple[int, ...],
) -> CpMirror:
    """Zigzag mirror rows of rank ``cp_rank`` and the ``ks``/``ke`` key range of each.

    Args:
        cu_seqlens_q: ``[n_seq + 1]`` exclusive prefix sum of the query rows being mirrored
            (the full chunk, or the compact YoCo rows).
        cu_seqlens_k: ``[n_seq + 1]`` exclusive prefix sum of the ORIGINAL key lengths. The
            absolute position of local row ``j`` is ``seqlen_k - seqlen_q + j``; with compact
            YoCo rows (the last rows of each chunk) this still gives their true positions,
            which is why the original ``cu_seqlens_k`` must be passed.
        cp_size, cp_rank: the context-parallel group.
        ratios: compression ratios for ``ks``/``ke``; ``ke = base_s + (pos + 1) // r`` where
            ``base_s`` sums :func:`compressed_kv_len` of the earlier sequences.
    Example (``seqlen_q = 10``, ``cp_size = 2``, rank 0): ``mirror_cp_index = [0 1 2 9 -1 -1]``.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    cu_q = _as_np("cu_seqlens_q", cu_seqlens_q)
    cu_k = _as_np("cu_seqlens_k", cu_seqlens_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k has shape {cu_k.shape}, cu_seqlens_q {cu_q.shape}")
    seqlen_q = np.diff(cu_q)
    seqlen_k = np.diff(cu_k)
    if np.any(seqlen_q > seqlen_k):
        s = int(np.argmax(seqlen_q > seqlen_k))
        raise ValueError(f"seqlen_q[{s}] = {seqlen_q[s]} exceeds seqlen_k[{s}] = {seqlen_k[s]}")
    n_seq = seqlen_q.size
    total_q = int(cu_q[-1])
    two_p = 2 * cp_size
    ps = cp_piece_size(seqlen_q, cp_size)  # [n_seq]
    mirror_off = exclusive_cumsum(2 * ps)
    mlen = int(mirror_off[-1])
    check_int32("cp_size * cp_mirror_len", cp_size * mlen)  # reverse-index range

    # mirror rows of this rank: local index j of each (seq, mirror row)
    seq_of = np.repeat(np.arange(n_seq), 2 * ps)  # [mlen]
    m_local = np.arange(mlen) - mirror_off[seq_of]
    ps_row = ps[seq_of]
    late = m_local >= ps_row
    piece = np.where(late, two_p - 1 - cp_rank, cp_rank)
    j = piece * ps_row + (m_local - late * ps_row)
    valid = j < seqlen_q[seq_of]
    mirror_index = np.where(valid, cu_q[seq_of] + j, -1)

    # reverse: global row -> (owner rank, its mirror row)
    seq_g = np.repeat(np.arange(n_seq), seqlen_q)  # [total_q]
    j_g = np.arange(total_q) - cu_q[seq_g]
    ps_g = ps[seq_g]
    b = j_g // np.maximum(ps_g, 1)
    owner = np.where(b < cp_size, b, two_p - 1 - b)
    row = mirror_off[seq_g] + np.where(b < cp_size, 0, ps_g) + j_g % np.maximum(ps_g, 1)
    reverse = owner * mlen + row

    pos = (seqlen_k - seqlen_q)[seq_of] + j  # absolute position of each mirror row
    ks: dict[str, torch.Tensor] = {}
    ke: dict[str, torch.Tensor] = {}
    for r in ratios:
        base = exclusive_cumsum(compressed_kv_len(seqlen_k, r))
        ks_r = np.where(valid, base[seq_of], 0)
        ke_r = np.where(valid, base[seq_of] + (pos + 1) // r, 0)
        ks[ratio_key(r)] = torch.from_numpy(ks_r.astype(np.int32))
        ke[ratio_key(r)] = torch.from_numpy(ke_r.astype(np.int32))
    return CpMirror(
        mirror_cp_index=torch.from_numpy(mirror_index.astype(np.int32)),
        mirror_cp_reverse_index=torch.from_numpy(reverse.astype(np.int32)),
        ks=ks,
        ke=ke,
        cp_mirror_len=mlen,
    )


def gather_rows(t: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
    """``t[index]`` along dim 0 with ``fill`` where ``index == -1`` (index int32 on any device)."""
    idx = index.to(device=t.device, dtype=torch.long)
    pad = idx < 0
    out = t[idx.clamp(min=0)]
    if bool(pad.any()):
        out[pad] = fill
    return out


def apply_mirror(view: MetadataFields, m: CpMirror, cp_size: int, cp_rank: int) -> None:
    """Move the query-aligned fields of ``view`` to the mirror rows ``m`` (in place).

    Gathered (pad rows get an inert value): ``positions`` (original kept as ``positions_cp``),
    ``ngram_token_ids``, ``query_indices`` (998244353), ``kv_swa_full_index_pivots`` (zeros =
    nothing visible), ``kv_ca_index_offset_len`` (length 0), the image mask (original kept as
    ``images_seq_mask_full``); ``gate_force_random`` is kept and its mirror copy stored as
    ``gate_force_random_cp``; ``valid_token_mask = (mirror_cp_index != -1) & valid[row]``
    (placeholder rows stay invalid); ``ks``/``ke`` come from :func:`prepare_cp_mirror` (a model
    without sparse ratios ran it with the dummy ratio 1 and gets none). Kept as they are:
    ``input_ids``, cu_seqlens, load plans, write slots (the KV is all-gathered back to the
    original layout before it is stored). Derived fields are cleared for ``compute_attn_info``.
    """
    idx = m.mirror_cp_index
    view.positions_cp = view.positions
    view.positions = gather_rows(view.positions, idx, 0)
    if view.ngram_token_ids is not None:
        view.ngram_token_ids = gather_rows(view.ngram_token_ids, idx, 0)
    view.gate_force_random_cp = gather_rows(view.gate_force_random, idx, False)
    view.valid_token_mask = gather_rows(view.valid_token_mask, idx, False)
    view.query_indices = gather_rows(view.query_indices, idx, QUERY_INDEX_PLACEHOLDER)
    if view.kv_swa_full_index_pivots is not None:
        view.kv_swa_full_index_pivots = gather_rows(view.kv_swa_full_index_pivots, idx, 0)
    view.kv_ca_index_offset_len = {
        k: gather_rows(v, idx, 0) for k, v in view.kv_ca_index_offset_len.items()
    }
    images = getattr(view, "images_seq_mask", None)
    if images is not None:
        view.images_seq_mask_full = images
        view.images_seq_mask = gather_rows(images, idx, False)
    dev = view.positions.device
    if view.ks:  # sparse model: the ratios of the kernel are the ks keys
        view.ks = {k: m.ks[k].to(dev) for k in view.ks}
        view.ke = {k: m.ke[k].to(dev) for k in view.ke}
    view.mirror_cp_index = idx.to(dev)
    view.mirror_cp_reverse_index = m.mirror_cp_reverse_index.to(dev)
    view.cp_mirror_len = m.cp_mirror_len
    view.cp_size, view.cp_rank = cp_size, cp_rank
    view.clean()


def kernel_ratios(meta: MetadataFields) -> tuple[int, ...]:
    """Ratios handed to :func:`prepare_cp_mirror`: the sparse ratios (``ks`` keys) or, for a
    pure-dense model, the dummy ``(1,)`` whose output is dropped (the mirror needs one)."""
    return tuple(int(k) for k in meta.ks) or (1,)


def prepare_for_mirror_cp(meta: Meta, cp_size: int, cp_rank: int) -> Meta:
    """Rewrite a prompt ``meta`` into rank ``cp_rank``'s mirror layout, in place; returns it.

    See :func:`apply_mirror` for which fields move. New fields: ``mirror_cp_index``
    ``[cp_mirror_len]``, ``mirror_cp_reverse_index`` ``[total_q]``, ``cp_mirror_len``,
    ``positions_cp``, ``gate_force_random_cp``, ``cp_size``, ``cp_rank``. ``total_q`` and
    ``cu_seqlens_*`` keep describing the full step. YoCo fields must be filled BEFORE this call
    (compact first, then CP: :func:`kvplan.plan.yoco.get_consumer_view` mirrors the compact
    rows itself).
    """
    if not meta.is_prompt:
        raise ValueError("prepare_for_mirror_cp needs prompt metadata (is_prompt = False)")
    if getattr(meta, "mirror_cp_index", None) is not None:
        raise ValueError("meta is already in the CP mirror layout (mirror_cp_index is set)")
    m = prepare_cp_mirror(meta.cu_seqlens_q, meta.cu_seqlens_k, cp_size, cp_rank,
                          kernel_ratios(meta))  # fmt: skip
    apply_mirror(meta, m, cp_size, cp_rank)
    return meta


def zigzag_contrib(seqlen_q: np.ndarray, clip: np.ndarray, cp_size: int, cp_rank: int):
    """Rows of rank ``cp_rank``'s full-mirror pieces at local index ``>= clip`` (per sequence).

    For piece ``b`` of ``ps`` rows: ``max(min(ps * (b + 1), seqlen_q) - max(ps * b, clip), 0)``
    summed over the rank's two pieces; the YoCo pad length is the max over ranks of the sum.
    """
    seqlen_q = np.asarray(seqlen_q, dtype=np.int64)
    ps = cp_piece_size(seqlen_q, cp_size)
    total = np.zeros_like(seqlen_q)
    for b in (cp_rank, 2 * cp_size - 1 - cp_rank):
        hi = np.minimum(ps * (b + 1), seqlen_q)
        total += np.maximum(hi - np.maximum(ps * b, clip), 0)
    return total
