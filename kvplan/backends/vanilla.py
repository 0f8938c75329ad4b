"""Vanilla backend: gather each sequence's paged K/V into contiguous NHD, then torch SDPA.

The correctness anchor: no paged kernel, no page table; ``prepare()`` only asks the
manager for each sequence's block ids (``block_ids_per_seq``) and the slots of this step's new
tokens. ``forward`` stores K/V, then per sequence gathers ``kv_lens[b]`` tokens from the pool
into a contiguous ``[kv_len, Hkv, D]`` tensor (token-major, NHD) and runs
``scaled_dot_product_attention`` with an explicit boolean mask (causal + sliding window; none
for cross attention). Slow by design, obviously correct.

It also carries the sparse path: when ``use_sparse_attention`` says a layer is sparse, keys
outside the blocks listed in ``metadata.sparse_runtime_params`` are masked out as well.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvplan._checks import check_int32
from kvplan.backends.base import AttentionBackend
from kvplan.backends.block_tables import gather_rows
from kvplan.backends.paged_metadata import PagedMetadata
from kvplan.backends.sparse import use_sparse_attention
from kvplan.backends.staging import DeviceArena, DeviceExpander


class VanillaAttentionMetadata(PagedMetadata):
    """Metadata for the vanilla backend (KV layout NHD).

    After ``prepare()``:
        block_ids_per_seq: per pool, host int32 ``[num_seqs, max_blocks_per_seq]`` (every
            row's allocated blocks, reserved included; block 0 pads), and
            ``block_ids_per_seq_gpu`` its device copy. The host array is this step's staging
            buffer (on a CPU device the device buffer itself): read it before the next
            ``prepare()``.
        num_blocks_np: host int32 ``[num_seqs]``, logical blocks ``ceil(kv_lens / block_size)``.

    Staging: ``seq_lens``, every pool's slots and block table go to the device in ONE copy
    through a ``DeviceArena`` (capacity-sized, allocated once). The int64 slots occupy pairs
    of int32 arena entries at even offsets (little-endian), read back through
    ``view(torch.int64)``; ``block_ids_per_seq_gpu[pool]`` is a ``[num_seqs, width]`` view of
    its field. Both stay valid until the next ``prepare()`` rewrites the arena (stream
    order protects a forward already queued).
    """

    kv_layout = "NHD"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.is_cuda_graph:
            raise ValueError(
                "the vanilla backend builds fresh tensors every step and cannot feed a CUDA "
                "graph (is_cuda_graph=True); use 'block_offsets' or 'ragged'"
            )
        s, t = self.max_num_sequences, self.max_num_tokens
        mgr = self.kv_cache_manager
        pools = 0 if mgr is None else self._num_pools  # no slot/table fields without a cache
        width = self._max_blocks_per_seq
        check_int32("max_num_sequences * max_blocks_per_seq", s * width)
        check_int32("2 * max_num_tokens", 2 * t)
        # even sizes before the slots, so the int64 slots start 8-byte aligned
        fields = {"seq_lens": s + (s & 1)}
        if pools:  # per-row facts the device expands the slots from (expand_on_device)
            fields.update({"cu": (s + 1) + ((s + 1) & 1), "cached": s + (s & 1)})
        fields.update({f"slots{p}": 2 * t for p in range(pools)})
        fields.update({f"table{p}": s * width for p in range(pools)})
        self.arena = DeviceArena(fields, self.device)
        self._seq_lens_gpu = self.arena.view("seq_lens")  # staged with the other fields
        self._views: dict[tuple[int, int], tuple[list, list]] = {}
        o = self.arena.offsets  # per pool: (slots offset, table offset); hot-path constants
        self._pool_offsets = [(o[f"slots{p}"], o[f"table{p}"]) for p in range(pools)]

    def _prepare_backend(self) -> None:
        self.sparse_blocks: list[np.ndarray] | None = None
        if self.kv_cache_manager is None:
            self.block_ids_per_seq, self.block_ids_per_seq_gpu, self._slots_gpu = [], [], []
            self._stage_context_only({})
            return
        bs, width = self._block_size, self._max_blocks_per_seq
        n, k = self._num_seqs, self._num_kv_tokens
        # validate everything before staging starts (a CPU arena is written in place)
        decode = self.one_kv_token_per_row and self.decode_fast_path
        on_device = self._expands_tokens(decode)
        step = self._step_rows(decode=decode, per_token=not on_device)
        self.num_blocks_np = step.num_needed
        arena, o = self.arena, self.arena.offsets
        # Fields are written at their arena offsets straight into the staging buffer; every
        # size is within its capacity: n <= max_num_sequences (seq_lens setter), k <=
        # max_num_tokens (_prepare_common).
        host = arena.begin(self._pool_offsets[-1][1] + n * width)
        self._put_seq_lens(host, 0)  # the first field
        if on_device:
            host[o["cu"] : o["cu"] + n + 1] = self.cu_seqlens_kv_np
            host[o["cached"] : o["cached"] + n] = self.cached_np
        bt, tables = step.tables, []
        for p, (slots_at, table_at) in enumerate(self._pool_offsets):
            if not on_device:  # int64 slots as int32 pairs (values < 2^31: high words 0)
                step.write_slots(p, bs, host[slots_at : slots_at + 2 * k].view(np.int64))
            table = host[table_at : table_at + n * width].reshape(n, width)
            gather_rows(bt, p, out=table)
            tables.append(table)
        self.block_ids_per_seq = tables
        arena.commit()
        if on_device:
            self._expand_on_device()
        views = self._views.get((n, k))
        if views is None:  # device views per (rows, tokens): sizes repeat step after step
            if len(self._views) >= 256:
                self._views.clear()
            views = self._views[n, k] = (
                [arena.prefix(f"slots{p}", 2 * k, torch.int64) for p in range(self._num_pools)],
                [arena.prefix(f"table{p}", n * width, shape=(n, width))
                 for p in range(self._num_pools)],
            )  # fmt: skip
        self._slots_gpu, self.block_ids_per_seq_gpu = views
        if self.sparse_metadata_params is not None and use_sparse_attention(
            self.sparse_metadata_params
        ):
            self.sparse_blocks = self._sparse_block_masks(-(-self.max_kv_len // bs))

    _expand_slots64 = True  # int64 slots, as int32 pairs

    def _bind_expansion(self, expander: DeviceExpander, key: None) -> tuple:
        """The slots of a general step's tokens from ``cu`` / ``cached`` / ``table{p}``."""
        o, width = self.arena.offsets, self._max_blocks_per_seq
        return expander.bind(
            tokens=True, pages=False, cu_off=o["cu"], cached_off=o["cached"],
            table_off=o["table0"], table_pool_stride=self.max_num_sequences * width,
            row_stride=width, slots_off=o["slots0"], slots_pool_stride=2 * self.max_num_tokens,
            block_size=self._block_size,
        )  # fmt: skip

    def _sparse_block_masks(self, width: int) -> list[np.ndarray]:
        """Per sequence, the logical blocks the sparse selection keeps (host bool masks).

        Reads ``sparse_runtime_params.sparse_kv_indices`` / ``sparse_kv_offsets`` (host int
        tensors; a device tensor costs a sync here). Sparse layers without a selection are a
        caller error, never a silent fall back to dense attention.
        """
        rt = self.sparse_runtime_params
        if rt.sparse_kv_indices is None or rt.sparse_kv_offsets is None:
            raise ValueError(
                "sparse_metadata_params makes some layers sparse, so "
                "sparse_runtime_params.sparse_kv_indices and sparse_kv_offsets must be set"
            )
        idx = rt.sparse_kv_indices.cpu().numpy()
        off = rt.sparse_kv_offsets.cpu().numpy()
        if off.size != self.num_seqs + 1 or off[0] != 0 or (np.diff(off) < 0).any():
            raise ValueError(
                f"sparse_kv_offsets must be {self.num_seqs + 1} nondecreasing offsets from 0, "
                f"got {off.tolist()}"
            )
        if int(off[-1]) > idx.size:
            raise ValueError(f"sparse_kv_offsets end at {int(off[-1])} > {idx.size} indices")
        masks = []
        for b in range(self.num_seqs):
            sel = idx[off[b] : off[b + 1]]
            nb = int(self.num_blocks_np[b])
            if sel.size and (sel.min() < 0 or sel.max() >= nb):
                raise ValueError(
                    f"sparse_kv_indices of sequence {b} name a block outside [0, {nb})"
                )
            m = np.zeros(width, bool)
            m[sel] = True
            masks.append(m)
        return masks

    def slot_mapping(self, pool: int = 0) -> torch.Tensor:
        return self._slots_gpu[pool]


def gather_paged_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` logical tokens of one sequence as contiguous NHD.

    Args:
        cache: ``[num_blocks, block_size, Hkv, D]`` K or V cache of one layer.
        block_ids: int32 ``[>= ceil(num_tokens / block_size)]`` the sequence's blocks in order.
    Returns: ``[num_tokens, Hkv, D]`` (a copy).
    """
    bs = cache.shape[1]
    nb = -(-num_tokens // bs)
    blocks = cache.index_select(0, block_ids[:nb].long())  # [nb, bs, Hkv, D]
    return blocks.reshape(nb * bs, *cache.shape[2:])[:num_tokens]


def visibility_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: query i (position ``kv_len - q_len + i``) sees key j."""
    keys = torch.arange(kv_len, device=device)[None, :]
    if not causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


class VanillaAttention(AttentionBackend):
    """Gather + SDPA, one sequence at a time (see the module docstring)."""

    name = "vanilla"
    Metadata = VanillaAttentionMetadata
    supports_sparse = True

    def _attend(self, q, k, v, metadata, pool, out):
        md: VanillaAttentionMetadata = metadata
        window = self.window(md)
        causal = not md.is_cross
        groups = self.num_heads // self.num_kv_heads
        sparse = self.uses_sparse(md) and md.sparse_blocks is not None
        cu_q = md.cu_seqlens_q_np
        cu_kv = md.cu_seqlens_kv_np
        if md.kv_cache_manager is not None:
            k_cache = md.kv_cache.k_cache(self.layer_idx)
            v_cache = md.kv_cache.v_cache(self.layer_idx)
            table = md.block_ids_per_seq_gpu[pool]
            bs = md.kv_cache.block_size
        for b in range(md.num_seqs):
            q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
            if q1 == q0:
                continue
            kv_len = int(md.kv_lens_np[b])
            if kv_len == 0:
                raise ValueError(f"sequence {b} has queries but no keys (kv_lens = 0)")
            if md.kv_cache_manager is None:
                k_b = k[cu_kv[b] : cu_kv[b + 1]]
                v_b = v[cu_kv[b] : cu_kv[b + 1]]
            elif md.kv_cache.is_quantized:  # dequantize the sequence's blocks (fp8 -> bf16)
                nb = -(-kv_len // bs)
                # ids were checked on the host (_step_rows): no device-side range check (a sync)
                k_b, v_b = md.kv_cache.read_blocks(self.layer_idx, table[b, :nb], check=False)
                k_b = k_b.reshape(nb * bs, *k_b.shape[2:])[:kv_len]
                v_b = v_b.reshape(nb * bs, *v_b.shape[2:])[:kv_len]
            else:
                k_b = gather_paged_kv(k_cache, table[b], kv_len)
                v_b = gather_paged_kv(v_cache, table[b], kv_len)
            mask = visibility_mask(q1 - q0, kv_len, causal=causal, window=window, device=q.device)
            if sparse:
                keep = torch.from_numpy(md.sparse_blocks[b]).to(q.device)
                mask = mask & keep.repeat_interleave(bs)[:kv_len][None, :]
            if md.recent is not None and md.kv_cache_manager is not None and causal:
                k_b, v_b, mask = md.recent.overlay(self.layer_idx, b, k_b, v_b, mask)
            # [H, q_len, D] x [H, kv_len, D]
            qh = q[q0:q1].transpose(0, 1)
            kh = k_b.to(q.dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
            vh = v_b.to(q.dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
            out[q0:q1] = o.transpose(0, 1)
        return out
