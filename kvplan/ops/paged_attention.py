"""Paged attention that reads KV through a flat page table (decode with split-K, varlen prefill).

Page table (shared by the ragged and block-offsets backends)::

    page_ids   int32 flat   [ 7  3  9 | 4 12 | ... ]        ragged: paged_kv_indices
    page_start int32 [B]    [ 0,       3,      ... ]        ragged: paged_kv_indptr[:-1]
                                                            block offsets: b * row_stride
    key position p of sequence b  ->  block page_ids[page_start[b] + p // block_size],
                                      row   p % block_size

Caches are ``[num_blocks, block_size, Hkv, D]`` (NHD within a block; any block/token/head
strides, unit stride on D). Only the pages that hold visible keys are read: a sequence of
``kv_len`` keys uses ``ceil(kv_len / block_size)`` pages (so a reserved speculative page past
the logical length is never touched), and pages wholly before a sliding window are skipped.

Visibility: query i of sequence b (``q_len_b`` queries) sits at absolute position
``p = kv_lens[b] - q_len_b + i`` -- its own K/V is already in the cache -- and sees keys
``max(0, p - W + 1) .. p`` (``W = sliding_window``; ``None`` = unbounded). A query that sees
no key (``kv_lens[b] == 0`` in decode) gets an all-zero output row.

Entry points (op convention): ``paged_attention_{decode,prefill}`` dispatch (CUDA -> Triton,
CPU -> torch); ``*_triton`` launch the kernels (also on CPU under ``TRITON_INTERPRET=1``);
``*_torch`` are the vectorized padded-batch torch paths; ``paged_attention_ref`` is the
per-query loop used by tests.

Quantized caches (``kv_layout`` = a token-interleaved, cast-on-load ``KVCacheFormat`` such as
the engine's fp8 / fp4): ``k_cache`` / ``v_cache`` are the raw uint8 ``[num_blocks,
block_size, 1, bytes_per_token]`` caches, each head's D values whole scale groups. The kernels
dequantize each K/V tile in registers (``kvplan.ops._paged_kv_tiles``) to q's dtype
(``fp32(value) * fp32(scale)``, one rounding: for bf16 the values of
``kvplan.quant.dequantize``); the torch path dequantizes the gathered keys with
``kvplan.quant.dequantize`` (bf16) and computes in fp32.

Recent-window ring (``ring=`` a `RecentRing`, any cache format): the newest keys of each
sequence read from a small unquantized ring instead of the pages (KIVI's full-precision
residual: bench/RESULTS.md, session 44, found fp8's loss in the newest rows). Key position
``p >= ring.lo[b]`` of sequence b is row ``ring.base[b] + p % ring.size`` of ``ring.k`` /
``ring.v`` (``[rows, Hkv, D]``, contiguous, q's dtype); older keys come from the pages. With
``ring.window = W > 0`` the bound is per query: the query at position ``p`` reads keys at
``>= max(p - W + 1, ring.lo[b])`` from the ring and older ones from the pages, so a key may
be exact for one query of a step and quantized for an earlier one (the kernels read such keys
from both sources under complementary masks). The caller keeps ``ring.lo[b] >= kv_lens[b] -
ring.size`` (the ring holds the last ``size`` positions) and writes the ring rows this step
attends.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvplan import quant
from kvplan.formats import KVCacheFormat
from kvplan.ops import _paged_attention_kernels as _k
from kvplan.ops import _paged_kv_tiles as tiles
from kvplan.ops._dispatch import cuda_sm_count, env_flag, use_triton
from kvplan.ops._paged_attention_checks import check_attention_inputs
from kvplan.ops._paged_kv_tiles import decode_maxnreg, decode_tiling


class RecentRing(NamedTuple):
    """The recent-window ring of a step (module docstring): ``k`` / ``v`` ``[rows, Hkv, D]``;
    ``base`` / ``lo`` int32 ``[B]``: each sequence's ring row of position 0 (mod ``size``)
    and its first position the ring holds for this step; ``size`` the ring's positions a
    sequence; ``window``: a query at position ``p`` reads its keys at positions
    ``>= max(p - window + 1, lo[b])`` from the ring (0: ``lo[b]`` alone, one bound for all of
    the sequence's queries)."""

    k: Tensor
    v: Tensor
    base: Tensor
    lo: Tensor
    size: int
    window: int = 0


def check_ring(ring: RecentRing | None, q: Tensor, kv_lens: Tensor, num_kv_heads: int) -> None:
    """Shapes, dtypes and devices of ``ring`` against the step (None passes)."""
    if ring is None:
        return
    if not isinstance(ring, RecentRing):
        raise TypeError(f"ring must be a RecentRing, got {type(ring).__name__}")
    d = q.shape[-1]
    for name, t in (("ring.k", ring.k), ("ring.v", ring.v)):
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, d) or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [rows, {num_kv_heads}, {d}] tensor, got "
                f"{tuple(t.shape)} (strides {t.stride()})"
            )
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    if ring.v.shape != ring.k.shape:
        raise ValueError(f"ring.v {tuple(ring.v.shape)} differs from ring.k {tuple(ring.k.shape)}")
    for name, t in (("ring.base", ring.base), ("ring.lo", ring.lo)):
        if t.dtype != torch.int32 or t.shape != kv_lens.shape or t.device != q.device:
            raise ValueError(
                f"{name} must be int32 {tuple(kv_lens.shape)} on {q.device}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    if isinstance(ring.size, bool) or not isinstance(ring.size, int) or ring.size < 1:
        raise ValueError(f"ring.size must be a positive int, got {ring.size!r}")


def _splits_from_env() -> int | None:
    """``KVPLAN_DECODE_SPLITS=n``: every decode launch that does not name its split count
    takes n (A/B runs of whole engines); unset: `default_num_splits`' rule."""
    text = os.environ.get("KVPLAN_DECODE_SPLITS", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise ValueError(f"KVPLAN_DECODE_SPLITS must be an int in [1, 1024], got {text!r}")
    return int(text)


SPLITS_OVERRIDE = _splits_from_env()


ONE_QUERY_ROWS_DECODE = env_flag("KVPLAN_ONE_QUERY_ROWS_DECODE", True)
"""`paged_attention_prefill_triton` hands calls whose rows hold one query each to the decode
kernel (True, the default); ``KVPLAN_ONE_QUERY_ROWS_DECODE=0`` at import keeps them on the
prefill kernel (A/B runs of whole engines)."""


def default_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Split-K factor for decode: about ``2 * num_sms`` programs, >= 256 keys per split.

    Extra splits only add partials and a combine once the grid already keeps every SM busy,
    so the factor is > 1 only when ``batch * num_kv_heads`` programs are fewer than
    ``2 * num_sms`` (``bench/bench_paged_attention.py`` sweeps it).

    >>> default_num_splits(64, 8, 4096, 132)  # 512 programs already fill 132 SMs
    1
    >>> default_num_splits(2, 8, 4096, 132)  # 16 programs; at most 4096 // 256 splits
    16
    """
    if SPLITS_OVERRIDE is not None:
        return SPLITS_OVERRIDE
    return _splits_within(-(-2 * num_sms // max(batch * num_kv_heads, 1)), max_kv_len)


def _splits_within(splits: int, max_kv_len: int) -> int:
    """``splits`` kept to [1, 64] and to >= 256 keys a split."""
    return max(1, min(splits, max_kv_len // 256, 64))


def resident_splits(
    batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int, programs_per_sm: int
) -> int:
    """Split-K factor that fills one wave of ``programs_per_sm`` resident programs on each of
    ``num_sms`` SMs (rounded down, >= 256 keys per split; 1 when the pairs alone fill it).

    >>> resident_splits(32, 8, 8192, 132, 6)  # 256 pairs, 792 slots: 3 splits
    3
    """
    return _splits_within(programs_per_sm * num_sms // max(batch * num_kv_heads, 1), max_kv_len)


def _decode_launch_plan(
    kv_layout, batch: int, num_kv_heads: int, max_kv_len: int | None, num_sms: int,
    num_warps: int, num_splits: int | None, maxnreg: int | None, key: str | None = None,
) -> tuple[int, int | None]:  # fmt: skip
    """``(num_splits, maxnreg)`` of a decode launch. A register cap lets more programs share an
    SM, which pays only with more programs: without a given split count a capped launch takes
    `resident_splits` where that exceeds `default_num_splits` (``max_kv_len``, read only
    then). A cap given here or by
    ``KVPLAN_DECODE_MAXNREG`` always applies, as do the entries of ``DECODE_MAXNREG_ALWAYS``;
    a format's other ``DECODE_MAXNREG`` entries only where they bring those extra splits (H200, fp8 at 32 x 8K: cap 168 x 3 splits 135.1 us, uncapped x 2
    splits 143.0, cap 168 x 2 splits 145.1; bench/RESULTS.md, session 21)."""
    given = maxnreg is not None or tiles.MAXNREG_OVERRIDE is not None
    given = given or key in tiles.DECODE_MAXNREG_ALWAYS
    cap = decode_maxnreg(kv_layout, maxnreg, key)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_kv_len, num_sms)
        if cap is not None and SPLITS_OVERRIDE is None:
            per_sm = 65536 // (cap * 32 * num_warps)
            capped = resident_splits(batch, num_kv_heads, max_kv_len, num_sms, per_sm)
            if capped > num_splits:
                return capped, cap
    return num_splits, cap if given else None


def _num_sms(device: torch.device) -> int:
    return cuda_sm_count(device) if device.type == "cuda" else 4


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: torch.Tensor,
    page_start: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_kv_len: int | None = None,
    kv_layout: KVCacheFormat | None = None,
    check: bool = True,
    ring: RecentRing | None = None,
) -> torch.Tensor:
    """One query per sequence at position ``kv_lens[b] - 1`` attends over its paged KV.

    Args:
        q: ``[B, H, D]`` bf16/fp16/fp32 (any row/head strides).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same dtype and device as q;
            ``H % Hkv == 0`` (GQA); D a power of two in [16, 256]. With ``kv_layout``: uint8
            ``[num_blocks, block_size, 1, bytes_per_token]`` caches of that quantized format
            (see the module docstring).
        page_ids: int32 flat page table; page_start: int32 ``[B]``; kv_lens: int32 ``[B]`` keys
            per sequence including the new token (0 gives a zero output row).
        scale: softmax scale (usually ``D ** -0.5``). sliding_window: W or None.
        out: optional ``[B, H, D]`` destination (written in place, CUDA-graph friendly).
        num_splits: split-K factor (Triton only); None picks one from ``max_kv_len`` (a host
            int; when None too it is estimated as ``page_ids.numel() // B * block_size``, so
            there is no device sync).
        kv_layout: the ``KVCacheFormat`` of quantized caches; None for float caches.
        check: value-range checks (one device sync on CUDA); pass False on a hot path.
        ring: the recent-window ring (module docstring) or None.

    Returns ``out`` (or a new tensor) ``[B, H, D]`` in q's dtype.

    Example (block_size 4, sequence 0 holds 6 keys in blocks 7 and 3)::

        page_ids = [7, 3, 9, 4], page_start = [0, 2], kv_lens = [6, 5]
        keys of sequence 0: positions 0-3 in block 7, positions 4-5 in block 3 (rows 0-1)
    """
    if use_triton(q):
        return paged_attention_decode_triton(
            q, k_cache, v_cache, page_ids, page_start, kv_lens, scale=scale,
            sliding_window=sliding_window, out=out, num_splits=num_splits,
            max_kv_len=max_kv_len, kv_layout=kv_layout, check=check, ring=ring,
        )  # fmt: skip
    return paged_attention_decode_torch(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, scale=scale,
        sliding_window=sliding_window, out=out, kv_layout=kv_layout, check=check, ring=ring,
    )  # fmt: skip


def paged_attention_decode_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_ids: Tensor, page_start: Tensor,
    kv_lens: Tensor, *, scale: float, sliding_window: int | None = None,
    out: Tensor | None = None, num_splits: int | None = None, max_kv_len: int | None = None,
    kv_layout: KVCacheFormat | None = None, check: bool = True, tile_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, prefetch: int | None = None,
    maxnreg: int | None = None, heads_first: bool | None = None, heads: int | None = None,
    ring: RecentRing | None = None,
) -> Tensor:  # fmt: skip
    """Triton decode (split-K + combine); same contract as :func:`paged_attention_decode`.
    ``tile_n`` / ``num_warps`` / ``num_stages``: launch overrides (see ``kvplan.ops._paged_kv_tiles.decode_tiling``;
    None takes the format's default); ``prefetch``: how whole key tiles load, one of
    ``kvplan.ops._paged_attention_kernels.PREFETCH_MODES`` (None:
    ``QUANT_PREFETCH``, then ``DECODE_PREFETCH`` by the launch's ``decode_key``: mode 2 for
    fp8 / int8 pages and fp4 pages read as fp16 tiles, 1 for fp4 pages as bf16 tiles);
    ``maxnreg``: a register cap per thread for the compiler (0: none; None: the key's
    ``DECODE_MAXNREG`` entry where `_decode_launch_plan` finds it pays); ``heads_first``: the
    programs' order (``kvplan.ops._paged_attention_kernels.DECODE_HEADS_FIRST`` for None);
    ``heads``: KV heads a program (``kvplan.ops._paged_attention_kernels.decode_heads``)."""
    window, num_kv_heads = check_attention_inputs(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, None, scale, sliding_window, out,
        kv_layout, check,
    )  # fmt: skip
    check_ring(ring, q, kv_lens, num_kv_heads)
    batch, _, head_dim = q.shape
    geo = tiles.kv_geometry(k_cache, v_cache, head_dim, kv_layout)
    # fp4's fp16 tiles rescale and reorder q's columns, which the ring's tiles are not
    kv_quant = geo.kv_quant if ring is not None else _k._kv_quant(geo, q, k_cache, v_cache)
    key = _k.decode_key(kv_layout, kv_quant)
    if max_kv_len is None:  # the split rule's and `auto_heads`' key count
        max_kv_len = page_ids.numel() // max(batch, 1) * k_cache.shape[1]
    if sliding_window is not None:
        max_kv_len = min(max_kv_len, sliding_window)
    heads = _k.decode_heads(
        geo, head_dim, q.shape[1] // num_kv_heads, heads, k_cache.element_size(), key,
        max_kv_len, batch,
    )  # fmt: skip
    tile_n, num_warps, num_stages = decode_tiling(kv_layout, tile_n, num_warps, num_stages, heads)
    num_splits, maxnreg = _decode_launch_plan(
        kv_layout, batch, num_kv_heads // heads, max_kv_len, _num_sms(q.device), num_warps, num_splits,
        maxnreg, key,
    )  # fmt: skip
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be an int in [1, 1024], got {num_splits!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return _k.launch_decode(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, out, scale=float(scale),
        window=window, num_splits=num_splits, kv_layout=kv_layout, tile_n=tile_n,
        num_warps=num_warps, num_stages=num_stages, prefetch=prefetch,
        maxnreg=maxnreg, geo=geo, kv_quant=kv_quant, heads_first=heads_first, heads=heads,
        ring=ring,
    )  # fmt: skip


def paged_attention_decode_torch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_ids: Tensor, page_start: Tensor,
    kv_lens: Tensor, *, scale: float, sliding_window: int | None = None,
    out: Tensor | None = None, kv_layout: KVCacheFormat | None = None, check: bool = True,
    ring: RecentRing | None = None,
) -> Tensor:  # fmt: skip
    """Vectorized torch decode; same contract as :func:`paged_attention_decode`."""
    _, num_kv_heads = check_attention_inputs(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, None, scale, sliding_window, out,
        kv_layout, check,
    )  # fmt: skip
    check_ring(ring, q, kv_lens, num_kv_heads)
    return _attention_torch(
        q, k_cache, v_cache, page_ids, page_start, None, kv_lens, scale, sliding_window, out,
        kv_layout, ring,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Prefill (varlen causal; also decode rows with several query tokens)
# ---------------------------------------------------------------------------------------------


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: torch.Tensor,
    page_start: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    max_q_len: int | None = None,
    kv_layout: KVCacheFormat | None = None,
    check: bool = True,
    ring: RecentRing | None = None,
) -> torch.Tensor:
    """Varlen causal attention of ``q`` over paged KV (chunked prefill, speculative rows).

    Args:
        q: ``[T, H, D]``; rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` are sequence b's
            queries, the last ``q_len_b`` positions of its ``kv_lens[b]`` keys.
        cu_seqlens_q: int32 ``[B + 1]``, 0 .. T. Other arguments as in decode.
        max_q_len: host bound on every ``q_len_b`` (sizes the Triton grid; the default T is
            always safe). A bound that is too small leaves rows unwritten; ``check`` catches it.
        ring: the recent-window ring (module docstring) or None.

    Returns ``out`` (or a new tensor) ``[T, H, D]``.

    Example (chunked prefill over cached history): a sequence with 10 cached tokens and a
    4-token chunk has ``kv_lens = 14``, ``q_len = 4``; its queries sit at positions 10..13,
    and query 10 sees keys 0..10.
    """
    if use_triton(q):
        return paged_attention_prefill_triton(
            q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, scale=scale,
            sliding_window=sliding_window, out=out, max_q_len=max_q_len, kv_layout=kv_layout,
            check=check, ring=ring,
        )  # fmt: skip
    return paged_attention_prefill_torch(
        q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, scale=scale,
        sliding_window=sliding_window, out=out, kv_layout=kv_layout, check=check, ring=ring,
    )  # fmt: skip


def paged_attention_prefill_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_ids: Tensor, page_start: Tensor,
    cu_seqlens_q: Tensor, kv_lens: Tensor, *, scale: float, sliding_window: int | None = None,
    out: Tensor | None = None, max_q_len: int | None = None,
    kv_layout: KVCacheFormat | None = None, check: bool = True, tile_m: int | None = None,
    tile_n: int = 64, num_warps: int | None = None, num_stages: int | None = None,
    prefetch: int | None = None, ring: RecentRing | None = None,
) -> Tensor:  # fmt: skip
    """Triton varlen prefill; same contract as :func:`paged_attention_prefill` (``prefetch``
    as in :func:`paged_attention_decode_triton`).

    Tiles default to 128 query rows x 64 keys, 8 warps, 3 stages for 16-bit caches (the
    fastest of ``bench/bench_paged_attention.py``'s sweep) and 64 x 64, 4 warps, 2 stages for
    fp32, whose 128-row tiles would exceed the shared memory of a block at head_dim 256.

    One query a row (``max_q_len == 1`` and as many rows as queries, e.g. the decode rows of a
    step that also prefills) is a decode: with no launch override given, it runs the split-K
    decode kernel (`paged_attention_decode_triton`), whose programs cover a group of query
    heads each instead of a 128-row tile holding one token's few heads.
    """
    window, num_kv_heads = check_attention_inputs(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, cu_seqlens_q, scale, sliding_window,
        out, kv_layout, check,
    )  # fmt: skip
    check_ring(ring, q, kv_lens, num_kv_heads)
    overridden = (tile_m, num_warps, num_stages, prefetch) != (None, None, None, None)
    wide = q.element_size() <= 2
    tile_m = tile_m or (128 if wide else 64)
    num_warps = num_warps or (8 if wide else 4)
    num_stages = num_stages or (3 if wide else 2)
    if max_q_len is None:
        max_q_len = q.shape[0]
    elif (
        check and kv_lens.numel() and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) > max_q_len
    ):
        raise ValueError(f"max_q_len = {max_q_len} is below the longest query run")
    one_query_rows = max_q_len == 1 and q.shape[0] == kv_lens.shape[0]
    if one_query_rows and ONE_QUERY_ROWS_DECODE and not overridden:
        # every row holds one query (runs <= 1 adding up to B), at position kv_len - 1
        return paged_attention_decode_triton(
            q, k_cache, v_cache, page_ids, page_start, kv_lens, scale=scale,
            sliding_window=sliding_window, out=out, kv_layout=kv_layout, check=False, ring=ring,
        )  # fmt: skip
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return _k.launch_prefill(
        q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, out,
        scale=float(scale), window=window, max_q_len=max_q_len, kv_layout=kv_layout,
        tile_m=tile_m, tile_n=tile_n, num_warps=num_warps, num_stages=num_stages,
        prefetch=prefetch, ring=ring,
    )  # fmt: skip


def paged_attention_prefill_torch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_ids: Tensor, page_start: Tensor,
    cu_seqlens_q: Tensor, kv_lens: Tensor, *, scale: float, sliding_window: int | None = None,
    out: Tensor | None = None, kv_layout: KVCacheFormat | None = None, check: bool = True,
    ring: RecentRing | None = None,
) -> Tensor:  # fmt: skip
    """Vectorized torch prefill; same contract as :func:`paged_attention_prefill`."""
    _, num_kv_heads = check_attention_inputs(
        q, k_cache, v_cache, page_ids, page_start, kv_lens, cu_seqlens_q, scale, sliding_window,
        out, kv_layout, check,
    )  # fmt: skip
    check_ring(ring, q, kv_lens, num_kv_heads)
    return _attention_torch(
        q, k_cache, v_cache, page_ids, page_start, cu_seqlens_q, kv_lens, scale, sliding_window,
        out, kv_layout, ring,
    )  # fmt: skip


class _GatherPlan(NamedTuple):
    """Where each query row and key of a padded batch comes from, for every layer of a step
    (they share the page table): ``q_rows`` / ``q_ok`` ``[B, Qm]`` (None: row b * Qm + i is
    query i of sequence b), ``blocks`` / ``rows`` ``[B, Lk]`` (a column no query sees points
    at the sequence's last key) and ``slots`` ``[B * Lk]`` (``blocks * block_size + rows``,
    for caches whose rows are contiguous), ``mask`` ``[B, 1, Qm, Lk]`` (None: every query sees every
    key), ``seen`` ``[B, Qm]`` queries that see some key (None: all)."""

    q_rows: Tensor | None
    q_ok: Tensor | None
    blocks: Tensor
    rows: Tensor
    slots: Tensor
    mask: Tensor | None
    seen: Tensor | None
    max_q: int
    positions: Tensor  # [B, Lk] int64: the key position each column reads
    q_pos: Tensor  # [B, Qm] int64: each query's position


# the torch path's last plans on the CPU by (block size, window, rows, decode): key tensors
# (copies) and plan. A step's layers attend over the same page table (per window), so the
# first layer's plan serves the others.
_PLANS: dict = {}
_MAX_PLANS = 8


def _gather_plan(page_ids, page_start, cu_seqlens_q, kv_lens, block_size, window, num_tokens):
    """The `_GatherPlan` of a step (``cu_seqlens_q`` None: one query a sequence), or None
    when no sequence has a key. On the CPU it is reused while the page table's values are
    the same (compared, not assumed: the backends rewrite their buffers in place)."""
    keys = (page_ids, page_start, kv_lens) + (() if cu_seqlens_q is None else (cu_seqlens_q,))
    sizes = (block_size, window, num_tokens, cu_seqlens_q is None)
    cacheable = page_ids.device.type == "cpu"
    last = _PLANS.get(sizes) if cacheable else None
    if last is not None and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(last[0], keys, strict=True)
    ):
        return last[1]
    plan = _new_gather_plan(page_ids, page_start, cu_seqlens_q, kv_lens, block_size, window,
                            num_tokens)  # fmt: skip
    if cacheable:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[sizes] = (tuple(t.clone() for t in keys), plan)
    return plan


def _new_gather_plan(page_ids, page_start, cu_seqlens_q, kv_lens, block_size, window, num_tokens):
    dev = kv_lens.device
    batch = kv_lens.shape[0]
    kv = kv_lens.long()
    max_kv = int(kv.max())
    if max_kv == 0:
        return None
    if cu_seqlens_q is None:  # decode: query b is row b, at position kv_lens[b] - 1
        q_lens = torch.ones(batch, dtype=torch.long, device=dev)
        starts = torch.arange(batch, device=dev)
    else:
        cu = cu_seqlens_q.long()
        q_lens, starts = cu[1:] - cu[:-1], cu[:-1]
    max_q = int(q_lens.max())
    qi = torch.arange(max_q, device=dev)
    q_ok = qi[None, :] < q_lens[:, None]  # [B, Qm]
    q_rows = torch.where(q_ok, starts[:, None] + qi[None, :], 0)  # [B, Qm]
    q_pos = kv[:, None] - q_lens[:, None] + qi[None, :]  # [B, Qm]
    kj = torch.arange(max_kv, device=dev)
    k_ok = kj[None, :] < kv[:, None]  # [B, Lk]
    visible = k_ok[:, None, :] & q_ok[:, :, None] & (kj[None, None, :] <= q_pos[:, :, None])
    if window is not None:
        visible &= kj[None, None, :] > q_pos[:, :, None] - window  # [B, Qm, Lk]
    if bool(visible.all()):  # every query sees every gathered key (no padding, no window)
        mask = seen = None
        src = kj.expand(batch, max_kv)
    else:
        mask, seen = visible[:, None], visible.any(-1)
        # a column no query sees reads the sequence's last key instead (written this step,
        # so finite): slots outside the visible sets may hold anything, NaN included, and a
        # masked NaN would still reach the output through its zero probability
        last = (kv - 1).clamp(min=0)[:, None]
        src = torch.where(visible.any(1), kj[None, :], last)  # [B, Lk] key positions read
    slot = page_start.long()[:, None] + src // block_size
    blocks = torch.where(kv[:, None] > 0, page_ids.long()[slot.clamp(max=page_ids.numel() - 1)], 0)
    rows = src % block_size
    if bool(q_ok.all()) and batch * max_q == num_tokens:
        q_rows = q_ok = None  # row b * Qm + i is query i of sequence b: views, no gathers
    slots = (blocks * block_size + rows).view(-1)
    return _GatherPlan(q_rows, q_ok, blocks, rows, slots, mask, seen, max_q, src, q_pos)


def _attention_torch(
    q,
    k_cache,
    v_cache,
    page_ids,
    page_start,
    cu_seqlens_q,
    kv_lens,
    scale,
    window,
    out,
    kv_layout=None,
    ring=None,
):
    """Padded-batch attention in fp32: gather every sequence's keys (the gather plan shared
    by a step's layers, `_gather_plan`), then one call of torch's
    ``scaled_dot_product_attention`` (GQA in the call; a boolean mask only where some key of
    the padded batch is hidden), scatter. ``cu_seqlens_q`` None: one query a sequence.
    Quantized caches are dequantized per gathered key (``kvplan.quant.dequantize``, bf16).
    A query that sees no key gets zeros. ``ring``: keys from the recent-window ring where
    the module docstring says (`ring_overlay`)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2] if kv_layout is None else kv_layout.elements // head_dim
    group = num_heads // num_kv_heads
    batch = kv_lens.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0 or num_tokens == 0:
        return out
    plan = _gather_plan(page_ids, page_start, cu_seqlens_q, kv_lens, block_size, window,
                        num_tokens)  # fmt: skip
    if plan is None:  # no sequence has a key: every query sees none
        out.zero_()
        return out
    k = _gather_keys(k_cache, plan, kv_layout, head_dim)  # [B, Lk, Hkv, D]
    v = _gather_keys(v_cache, plan, kv_layout, head_dim)
    attn_mask = plan.mask
    if ring is not None:
        vis = None if plan.mask is None else plan.mask[:, 0]
        k, v, vis = ring_keys(k, v, plan.positions, plan.q_pos, vis, ring,
                              ring_bound_is_per_sequence(ring, kv_lens))  # fmt: skip
        attn_mask = None if vis is None else vis[:, None]
    if plan.q_rows is None:
        qq = q.float().view(batch, plan.max_q, num_heads, head_dim)
    else:
        qq = q[plan.q_rows].float()
    o = F.scaled_dot_product_attention(
        qq.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        scale=scale,
        enable_gqa=group > 1,
    ).transpose(1, 2)  # [B, Qm, H, D]; rows that see no key are NaN here
    if plan.seen is not None:
        o = torch.where(plan.seen[:, :, None, None], o, 0.0)
    if plan.q_rows is None:
        out.copy_(o.reshape(num_tokens, num_heads, head_dim))
    else:
        out[plan.q_rows[plan.q_ok]] = o[plan.q_ok].to(out.dtype)
    return out


def ring_bound_is_per_sequence(ring: RecentRing, kv_lens: Tensor) -> bool:
    """Whether every query of a sequence has the same ring bound ``ring.lo[b]`` (no
    ``window``, or ``lo[b] >= kv_lens[b] - window``: the bound of the sequence's last query;
    one host sync on CUDA)."""
    return not ring.window or bool((ring.lo >= kv_lens - ring.window).all())


def ring_keys(
    k: Tensor, v: Tensor, positions: Tensor, q_pos: Tensor, vis: Tensor | None,
    ring: RecentRing, one_bound: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The keys and values attention reads with a ring, and the visibility that goes with
    them: ``k`` / ``v`` fp32 ``[B, Lk, Hkv, D]`` at key ``positions`` ``[B, Lk]``, the queries
    at ``q_pos`` ``[B, Qm]`` seeing ``vis`` (bool ``[B, Qm, Lk]``, None: every key).
    ``one_bound`` (every query of a sequence bounded by ``ring.lo[b]``,
    `ring_bound_is_per_sequence`): the ring's rows replace the keys from ``lo`` on, ``vis``
    unchanged; else the pages' keys then the ring's (``2 Lk``) and ``vis`` widened to match,
    each query seeing a key in one of the two (`ring_exact`)."""
    kr, vr = ring_overlay(k, v, positions, ring)
    if one_bound:
        return kr, vr, vis
    exact = ring_exact(q_pos, positions, ring)  # [B, Qm, Lk]
    vis = exact.new_ones(()) if vis is None else vis
    return (torch.cat((k, kr), 1), torch.cat((v, vr), 1),
            torch.cat((vis & ~exact, vis & exact), -1))  # fmt: skip


def ring_exact(q_pos: Tensor, positions: Tensor, ring: RecentRing) -> Tensor:
    """Bool ``[B, Qm, Lk]``: whether query ``(b, i)`` at ``q_pos[b, i]`` reads key column
    ``(b, j)`` at ``positions[b, j]`` from the ring: ``>= max(q_pos - ring.window + 1,
    ring.lo[b])`` (``ring.window > 0``)."""
    lo = torch.maximum(q_pos - ring.window + 1, ring.lo.long()[:, None])  # [B, Qm]
    return positions[:, None, :] >= lo[:, :, None]


def ring_overlay(k: Tensor, v: Tensor, positions: Tensor, ring: RecentRing):
    """``k`` / ``v`` (fp32 ``[B, Lk, Hkv, D]`` at key ``positions`` [B, Lk]) with every key
    at a position ``>= ring.lo[b]`` replaced by its ring row."""
    use = positions >= ring.lo.long()[:, None]  # [B, Lk]
    rows = (ring.base.long()[:, None] + positions % ring.size).clamp(0, ring.k.shape[0] - 1)
    pick = use[:, :, None, None]
    return (torch.where(pick, ring.k[rows].float(), k),
            torch.where(pick, ring.v[rows].float(), v))  # fmt: skip


def _gather_keys(cache, plan: _GatherPlan, kv_layout, head_dim) -> Tensor:
    """fp32 ``[B, Lk, Hkv, D]`` values of the keys at the plan's (``blocks``, ``rows``)."""
    if cache.is_contiguous():  # one index_select over the cache's rows (faster on the CPU)
        picked = cache.view(-1, *cache.shape[2:]).index_select(0, plan.slots)
        picked = picked.view(*plan.blocks.shape, *cache.shape[2:])
    else:
        picked = cache[plan.blocks, plan.rows]
    if kv_layout is None:
        return picked.float()
    records = picked[:, :, 0]  # [B, Lk, bytes_per_token] uint8
    nv, ns = kv_layout.quantized_bytes, kv_layout.sf_bytes
    flat = records.flatten(0, 1)
    vals = quant.dequantize(flat[:, :nv], flat[:, nv : nv + ns], kv_layout)  # [B*Lk, E] bf16
    return vals.float().view(*plan.blocks.shape, -1, head_dim)


# ---------------------------------------------------------------------------------------------
# Reference (tests only)
# ---------------------------------------------------------------------------------------------


def paged_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_ids: Tensor, page_start: Tensor,
    cu_seqlens_q: Tensor | None, kv_lens: Tensor, *, scale: float,
    sliding_window: int | None = None,
) -> Tensor:  # fmt: skip
    """Per-query loop in float64; ``cu_seqlens_q=None`` means decode (one query per sequence).

    For each query it lists the visible key positions, looks every one up in the page table,
    and takes a plain softmax. Returns ``[T, H, D]`` in q's dtype, on the CPU.
    """
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    page_ids, page_start, kv_lens = page_ids.tolist(), page_start.tolist(), kv_lens.tolist()
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = len(kv_lens)
    cu = list(range(batch + 1)) if cu_seqlens_q is None else [int(c) for c in cu_seqlens_q]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        q_len, kv_len = cu[b + 1] - cu[b], int(kv_lens[b])
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys, vals = [], []
            for j in range(lo, pos + 1):
                block = int(page_ids[int(page_start[b]) + j // block_size])
                keys.append(k_cache[block, j % block_size].double())  # [Hkv, D]
                vals.append(v_cache[block, j % block_size].double())
            if not keys:
                continue
            kk = torch.stack(keys).repeat_interleave(group, dim=1)  # [n, H, D]
            vv = torch.stack(vals).repeat_interleave(group, dim=1)
            qq = q[cu[b] + i].double()  # [H, D]
            w = torch.softmax(torch.einsum("hd,nhd->hn", qq, kk) * scale, dim=-1)
            out[cu[b] + i] = torch.einsum("hn,nhd->hd", w, vv)
    return out.to(q.dtype)
