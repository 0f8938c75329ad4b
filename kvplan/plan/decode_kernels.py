"""The two kernels of the on-device decode step, each with its vectorized torch path.

``decode_metadata`` writes EVERY per-token field of a decode step, for every ratio, in one
launch (one program per sequence); ``expand_block_tables`` copies each sequence's compact
block table into the per-token ``block_tables`` rows. Both read only per-sequence facts
(O(n_seq) numbers extracted on the CPU, see :mod:`kvplan.plan.decode_device`).

Per-sequence inputs (int32, on the output device):
    cu_seqlens_q ``[n_prog + 1]`` (exclusive prefix sum; programs past the real batch see
    ``seqlen_q = 0`` and write nothing, which is how a CUDA graph captured for a larger batch
    replays a smaller one), seqlens_k ``[n_prog]``, state_ids ``[n_prog]``,
    is_placeholder ``[n_prog]`` (0/1), swa_valid_start ``[n_prog]``, block_tables_in
    ``[sum_s nb_s]`` (compact) and block_tables_offsets ``[n_prog + 1]``, and the ratio table
    ``[ca ratios | sparse ratios | dense ratios]`` (device memory, so a captured launch does no
    host-to-device copy). Prefix sums are exclusive, ``[n + 1]``, as everywhere in kvplan.

For query row ``i`` of sequence ``s`` (local index ``j``, position ``p = seqlen_k - seqlen_q + j``,
``valid = not placeholder``), the fields are (``bs`` = swa_block_size, ``W`` = window_size)::

    positions = p                 context_lens = p + 1          state_block_idx = state_id
    valid_token_mask = valid      gate_force_random = force     query_indices = s | 998244353
    slot_mapping_store_swa = state_id * bs + p % bs  if valid and seqlen_q - j <= bs else -1
    kv_swa_index_offset_len = (state_id * bs + lo % bs, p - lo + 1),
                              lo = min(max(p - W + 1, swa_valid_start, 0), p + 1)
    per ca ratio r (tpb = block_size // r, c = p // r):
        positions_c = c * r, slot_mapping_store_ca = block_table[c // tpb] * tpb + c % tpb
        if valid and (p + 1) % r == 0, else 0 / -1
    per sparse ratio r: klen = (p + 1) // r
    per dense ratio r: kv_ca_index_offset_len = (i * max_num_blocks * tpb, (p + 1) // r)

Per-ratio outputs are stacked ``[n_ratio, q_stride]`` (``kv_ca_index_offset_len``:
``[n_ratio, q_stride, 2]``) with any row stride, so the rows can be prefixes of CUDA-graph
buffers captured at a larger ``q_stride``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.plan.config import QUERY_INDEX_PLACEHOLDER


@dataclass
class DecodeKernelInputs:
    """Per-sequence int32 facts on the output device (see the module docstring)."""

    cu_seqlens_q: torch.Tensor  # [n_prog + 1]
    seqlens_k: torch.Tensor  # [n_prog]
    state_ids: torch.Tensor  # [n_prog]
    is_placeholder: torch.Tensor  # [n_prog]
    swa_valid_start: torch.Tensor  # [n_prog]
    block_tables_in: torch.Tensor  # [num_blocks_total]
    block_tables_offsets: torch.Tensor  # [n_prog + 1]
    ratios: torch.Tensor  # [>= 1] ca ratios, then sparse ratios, then dense ratios
    max_seqlen_q: int  # upper bound of seqlen_q over the programs


@dataclass
class DecodeKernelOutputs:
    """Destinations; every tensor has at least ``total_q`` rows (``q_stride`` of them)."""

    positions: torch.Tensor  # [q_stride]
    valid_token_mask: torch.Tensor  # [q_stride] bool
    gate_force_random: torch.Tensor  # [q_stride] bool
    query_indices: torch.Tensor  # [q_stride]
    context_lens: torch.Tensor  # [q_stride]
    slot_mapping_store_swa: torch.Tensor  # [q_stride]
    state_block_idx: torch.Tensor  # [q_stride]
    kv_swa_index_offset_len: torch.Tensor  # [q_stride, 2]
    positions_c: torch.Tensor  # [n_ca, q_stride]
    slot_mapping_store_ca: torch.Tensor  # [n_ca, q_stride]
    klen: torch.Tensor  # [n_sparse, q_stride]
    kv_ca_index_offset_len: torch.Tensor  # [n_dense, q_stride, 2]


@dataclass(frozen=True)
class DecodeKernelParams:
    """Scalars of the step (from ``MetadataConfig``)."""

    ca_ratios: tuple[int, ...]
    sparse_ratios: tuple[int, ...]
    dense_ratios: tuple[int, ...]
    block_size: int
    window_size: int
    swa_block_size: int
    max_num_blocks: int
    force_load_balance: bool


_PLACEHOLDER = tl.constexpr(QUERY_INDEX_PLACEHOLDER)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# --------------------------------------------------------------------------- Triton kernels
@jit
def _decode_metadata_kernel(
    cu_q_ptr, seqlen_k_ptr, state_ptr, placeholder_ptr, valid_start_ptr, bt_ptr, bt_off_ptr,
    ratio_ptr,
    positions_ptr, valid_ptr, gate_ptr, qidx_ptr, ctx_ptr, swa_slot_ptr, state_idx_ptr,
    swa_ol_ptr, swa_ol_stride,
    pos_c_ptr, slot_ca_ptr, pos_c_rs, slot_ca_rs,
    klen_ptr, klen_rs, ca_ol_ptr, ca_ol_rs, ca_ol_stride,
    force_lb, block_size, window_size, swa_bs, max_num_blocks,
    N_CA: tl.constexpr, N_SPARSE: tl.constexpr, N_DENSE: tl.constexpr, TILE_Q: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    q0 = tl.load(cu_q_ptr + s)
    seqlen_q = tl.load(cu_q_ptr + s + 1) - q0
    seqlen_k = tl.load(seqlen_k_ptr + s)
    state = tl.load(state_ptr + s)
    valid = tl.load(placeholder_ptr + s) == 0
    valid_start = tl.load(valid_start_ptr + s)
    bt0 = tl.load(bt_off_ptr + s)
    qidx = tl.where(valid, s, _PLACEHOLDER)
    j = tl.arange(0, TILE_Q)  # TILE_Q >= max seqlen_q: decode rows fit one tile
    m = j < seqlen_q
    row = (q0 + j).to(tl.int64)
    p = seqlen_k - seqlen_q + j
    zero = j * 0  # broadcasts per-sequence scalars over the row tile
    tl.store(positions_ptr + row, p, mask=m)
    tl.store(ctx_ptr + row, p + 1, mask=m)
    tl.store(state_idx_ptr + row, zero + state, mask=m)
    tl.store(valid_ptr + row, (zero == 0) & valid, mask=m)
    tl.store(gate_ptr + row, (zero + force_lb) != 0, mask=m)
    tl.store(qidx_ptr + row, zero + qidx, mask=m)
    store_swa = valid & (seqlen_q - j <= swa_bs)
    tl.store(swa_slot_ptr + row, tl.where(store_swa, state * swa_bs + p % swa_bs, -1), mask=m)
    lo = tl.maximum(tl.maximum(p - window_size + 1, valid_start), 0)
    lo = tl.minimum(lo, p + 1)
    tl.store(swa_ol_ptr + row * swa_ol_stride, state * swa_bs + lo % swa_bs, mask=m)
    tl.store(swa_ol_ptr + row * swa_ol_stride + 1, p - lo + 1, mask=m)
    for k in tl.static_range(N_CA):
        r = tl.load(ratio_ptr + k)
        tpb = block_size // r
        c = p // r
        done = valid & ((p + 1) % r == 0)
        blk = tl.load(bt_ptr + bt0 + c // tpb, mask=m & done, other=0)
        tl.store(pos_c_ptr + k * pos_c_rs + row, tl.where(done, c * r, 0), mask=m)
        slot = tl.where(done, blk * tpb + c % tpb, -1)
        tl.store(slot_ca_ptr + k * slot_ca_rs + row, slot, mask=m)
    for k in tl.static_range(N_SPARSE):
        r = tl.load(ratio_ptr + N_CA + k)
        tl.store(klen_ptr + k * klen_rs + row, (p + 1) // r, mask=m)
    for k in tl.static_range(N_DENSE):
        r = tl.load(ratio_ptr + N_CA + N_SPARSE + k)
        base = ca_ol_ptr + k * ca_ol_rs + row * ca_ol_stride
        tl.store(base, row * (max_num_blocks * (block_size // r)), mask=m)
        tl.store(base + 1, (p + 1) // r, mask=m)


@jit
def _expand_block_tables_kernel(
    cu_q_ptr, bt_ptr, bt_off_ptr, out_ptr, out_rs, TILE_Q: tl.constexpr, TILE_B: tl.constexpr
):  # fmt: skip
    s = tl.program_id(0)
    cols = tl.program_id(1) * TILE_B + tl.arange(0, TILE_B)
    j = tl.arange(0, TILE_Q)
    q0 = tl.load(cu_q_ptr + s)
    seqlen_q = tl.load(cu_q_ptr + s + 1) - q0
    b0 = tl.load(bt_off_ptr + s)
    nb = tl.load(bt_off_ptr + s + 1) - b0
    cm = cols < nb
    vals = tl.load(bt_ptr + b0 + cols, mask=cm, other=0)  # [TILE_B]
    rows = (q0 + j).to(tl.int64)  # [TILE_Q]
    ptrs = out_ptr + rows[:, None] * out_rs + cols[None, :]
    m = (j < seqlen_q)[:, None] & cm[None, :]
    tl.store(ptrs, tl.broadcast_to(vals[None, :], (TILE_Q, TILE_B)), mask=m)


def ratio_table(prm: DecodeKernelParams) -> list[int]:
    """Contents of ``DecodeKernelInputs.ratios`` (never empty, so the pointer is valid)."""
    return [*prm.ca_ratios, *prm.sparse_ratios, *prm.dense_ratios] or [1]


def decode_metadata_triton(
    inp: DecodeKernelInputs, out: DecodeKernelOutputs, prm: DecodeKernelParams
) -> None:
    """Launch the metadata kernel: grid ``(n_prog,)``, one program per sequence."""
    n_prog = inp.seqlens_k.numel()
    if n_prog == 0:
        return
    cq = inp.cu_seqlens_q
    tile_q = _next_pow2(max(inp.max_seqlen_q, 1))
    _decode_metadata_kernel[(n_prog,)](
        cq, inp.seqlens_k, inp.state_ids, inp.is_placeholder, inp.swa_valid_start,
        inp.block_tables_in, inp.block_tables_offsets, inp.ratios,
        out.positions, out.valid_token_mask, out.gate_force_random, out.query_indices,
        out.context_lens, out.slot_mapping_store_swa, out.state_block_idx,
        out.kv_swa_index_offset_len, out.kv_swa_index_offset_len.stride(0),
        out.positions_c, out.slot_mapping_store_ca,
        out.positions_c.stride(0), out.slot_mapping_store_ca.stride(0),
        out.klen, out.klen.stride(0),
        out.kv_ca_index_offset_len, out.kv_ca_index_offset_len.stride(0),
        out.kv_ca_index_offset_len.stride(1),
        int(prm.force_load_balance), prm.block_size, prm.window_size, prm.swa_block_size,
        prm.max_num_blocks,
        N_CA=len(prm.ca_ratios), N_SPARSE=len(prm.sparse_ratios), N_DENSE=len(prm.dense_ratios),
        TILE_Q=tile_q,
    )  # fmt: skip


def expand_block_tables_triton(
    inp: DecodeKernelInputs, block_tables: torch.Tensor, max_num_blocks: int
) -> None:
    """Launch the block-table expansion: grid ``(n_prog, cdiv(max_num_blocks, TILE_B))``."""
    n_prog = inp.seqlens_k.numel()
    if n_prog == 0:
        return
    tile_q = _next_pow2(max(inp.max_seqlen_q, 1))
    tile_b = max(16, min(_next_pow2(max_num_blocks), 4096 // tile_q))
    grid = (n_prog, triton.cdiv(max_num_blocks, tile_b))
    _expand_block_tables_kernel[grid](
        inp.cu_seqlens_q, inp.block_tables_in, inp.block_tables_offsets, block_tables,
        block_tables.stride(0), TILE_Q=tile_q, TILE_B=tile_b,
    )  # fmt: skip


# --------------------------------------------------------------------------- torch paths
def _token_index(inp: DecodeKernelInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seq of each row, local index j, position p), int64 ``[total_q]``."""
    cq = inp.cu_seqlens_q.long()
    seqlen_q = cq[1:] - cq[:-1]
    total_q = int(cq[-1])
    seq = torch.repeat_interleave(torch.arange(seqlen_q.numel(), device=cq.device), seqlen_q)
    j = torch.arange(total_q, device=cq.device) - cq[seq]
    p = inp.seqlens_k.long()[seq] - seqlen_q[seq] + j
    return seq, j, p


def decode_metadata_torch(
    inp: DecodeKernelInputs, out: DecodeKernelOutputs, prm: DecodeKernelParams
) -> None:
    """Vectorized torch path of :func:`decode_metadata_triton` (same writes)."""
    seq, j, p = _token_index(inp)
    n = p.numel()
    cq = inp.cu_seqlens_q.long()
    state = inp.state_ids.long()[seq]
    valid = inp.is_placeholder[seq] == 0
    bs = prm.swa_block_size
    out.positions[:n] = p
    out.context_lens[:n] = p + 1
    out.state_block_idx[:n] = state
    out.valid_token_mask[:n] = valid
    out.gate_force_random[:n] = prm.force_load_balance
    out.query_indices[:n] = torch.where(valid, seq, QUERY_INDEX_PLACEHOLDER)
    store = valid & ((cq[1:] - cq[:-1])[seq] - j <= bs)
    out.slot_mapping_store_swa[:n] = torch.where(store, state * bs + p % bs, -1)
    lo = torch.clamp(p - prm.window_size + 1, min=0)
    lo = torch.minimum(torch.maximum(lo, inp.swa_valid_start.long()[seq]), p + 1)
    out.kv_swa_index_offset_len[:n, 0] = state * bs + lo % bs
    out.kv_swa_index_offset_len[:n, 1] = p - lo + 1
    bt0 = inp.block_tables_offsets.long()[seq]
    bt = inp.block_tables_in.long()
    for k, r in enumerate(prm.ca_ratios):
        tpb = prm.block_size // r
        c = p // r
        done = valid & ((p + 1) % r == 0)
        blk = bt[torch.where(done, bt0 + c // tpb, 0)] if bt.numel() else torch.zeros_like(c)
        out.positions_c[k, :n] = torch.where(done, c * r, 0)
        out.slot_mapping_store_ca[k, :n] = torch.where(done, blk * tpb + c % tpb, -1)
    for k, r in enumerate(prm.sparse_ratios):
        out.klen[k, :n] = (p + 1) // r
    rows = torch.arange(n, device=p.device)
    for k, r in enumerate(prm.dense_ratios):
        out.kv_ca_index_offset_len[k, :n, 0] = rows * (prm.max_num_blocks * (prm.block_size // r))
        out.kv_ca_index_offset_len[k, :n, 1] = (p + 1) // r


def expand_block_tables_torch(
    inp: DecodeKernelInputs, block_tables: torch.Tensor, max_num_blocks: int
) -> None:
    """Vectorized torch path of :func:`expand_block_tables_triton` (columns past a row's
    blocks are left untouched)."""
    seq, _, _ = _token_index(inp)
    off = inp.block_tables_offsets.long()
    nb = (off[1:] - off[:-1])[seq]  # [total_q]
    cols = torch.arange(max_num_blocks, device=off.device)
    row_i, col_i = torch.nonzero(cols[None, :] < nb[:, None], as_tuple=True)
    block_tables[row_i, col_i] = inp.block_tables_in[off[seq][row_i] + col_i].to(block_tables.dtype)


def decode_metadata(inp: DecodeKernelInputs, out: DecodeKernelOutputs, prm: DecodeKernelParams):
    """Dispatch: CUDA -> Triton kernel, CPU -> torch path."""
    if use_triton(inp.cu_seqlens_q):
        decode_metadata_triton(inp, out, prm)
    else:
        decode_metadata_torch(inp, out, prm)


def expand_block_tables(inp: DecodeKernelInputs, block_tables: torch.Tensor, max_num_blocks: int):
    """Dispatch: CUDA -> Triton kernel, CPU -> torch path."""
    if use_triton(inp.cu_seqlens_q):
        expand_block_tables_triton(inp, block_tables, max_num_blocks)
    else:
        expand_block_tables_torch(inp, block_tables, max_num_blocks)


_BACKENDS = {
    "auto": (decode_metadata, expand_block_tables),
    "triton": (decode_metadata_triton, expand_block_tables_triton),
    "torch": (decode_metadata_torch, expand_block_tables_torch),
}


def launch_decode(
    inp: DecodeKernelInputs,
    out: DecodeKernelOutputs,
    block_tables: torch.Tensor,
    prm: DecodeKernelParams,
    backend: str = "auto",
) -> None:
    """Both kernels: ``backend`` is ``"auto"`` (CUDA -> Triton, CPU -> torch), ``"triton"``
    (also on CPU under ``TRITON_INTERPRET=1``) or ``"torch"``. Graph-capturable on CUDA (no
    host sync, no host-to-device copy)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    metadata, expand = _BACKENDS[backend]
    metadata(inp, out, prm)
    expand(inp, block_tables, prm.max_num_blocks)
