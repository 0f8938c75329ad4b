"""Each sequence's newest keys and values kept unquantized beside a quantized KV cache.

A quantized cache (fp8 / int8 / fp4) loses most of its accuracy on the newest rows: a query
leans on the keys just before it (bench/RESULTS.md, session 44: keeping the last 16-128
positions exact lifted SmolLM2's teacher-forced top-1 agreement with fp8 from ~97.1 % to
~99.2 % and cut the KL by ~89 %; KIVI's full-precision residual). With
``EngineConfig(kv_exact_window=W)`` every K/V row is still stored in the quantized pages, and
also in a small ring in the attention dtype; attention reads a sequence's keys at positions
``>= lo`` from the ring (`kvplan.ops.paged_attention.RecentRing`), older ones from the pages::

    lo[b] = max(kv_len[b] - W, start[b])      start[b]: the first position the request wrote

(``start`` is past 0 when a prefix-cache hit supplied the first blocks: their rows were never
written to this request's ring, so they come from the pages.) Each query is bounded by its
own window: the query at ``p`` reads keys ``>= max(p - W + 1, start)`` exact and older ones
from the pages, so a position sees the same keys however its prompt was chunked, preempted
and recomputed, or verified with drafts -- the keys a one-token decode step at ``p`` sees.
Three kinds of step get there three ways:

* decode steps (one query): ``lo`` is that query's bound and the ring holds it;
* short steps (draft verification, ``1 < query <= slack + 1`` after the sequence's first
  step): ``lo`` = what the ring holds (``max(kv_len - size, start)``) and the ring's
  ``window`` bounds each query by itself (`kvplan.ops.paged_attention.RecentRing`);
* steps with a longer chunk (its first query's bound below the last one's, which the ring
  cannot hold: the chunk overwrites the older rows its first queries need): a per-step ring
  (`WideStep`). At the layer's store, before the ring is written, each sequence of the step
  gets a region of ``kv_len[b] - a[b]`` rows, ``a[b] = max(cached[b] - W + 1, start[b])``
  its first query's bound, holding positions ``a[b] .. kv_len[b] - 1`` in order: those
  before the chunk copied from the ring (which still holds them), the chunk's own from the
  step's new rows (cast to the ring's dtype). Attention reads that ring with ``lo = a`` and
  the window, so every query of the step, the other sequences' too, has its own bound. The
  attention kernels need no third source; the copy is ``W - 1 + query`` rows a sequence a
  layer (a decode beside a long chunk: ``W``), in prefill steps only (decode steps, and so
  CUDA graphs, never take it).

Layout: per layer, K and V rings ``[num_slots * size + 1, Hkv, D]``; slot ``s`` holds position
``p`` at row ``s * size + p % size``; the last row takes the writes of rows outside the ring
(a trash row, so a store needs no host-side filtering). ``size = W + slack``: a step with
draft positions also writes those, and a rejected draft at position ``p`` overwrites row
``p % size`` -- which, with ``slack`` the drafts a step may carry, belongs to a position
older than every later query's bound (the engine passes ``num_speculative_tokens``). Pages
stay complete, so prefix caching, preemption and the fallback paths need nothing from the
ring.

`RecentWindow` assigns each request a ring slot at its first planned step and frees it with the
request (`free`); `plan` turns a step's per-sequence facts into the device arrays of a
`RecentStep` (one small host computation and three non-blocking copies into persistent
buffers, so decode steps replay CUDA graphs with the ring as without it; `pad` readies a
graph bucket's padding rows).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvplan._math import exclusive_cumsum
from kvplan.backends.block_tables import new_token_positions
from kvplan.backends.staging.arena import to_device
from kvplan.ops._dispatch import use_triton
from kvplan.ops._launch import jit
from kvplan.ops.paged_attention import RecentRing, ring_keys

NO_RING = 1 << 30  # a ``lo`` past every ``kv_len``: the row reads no ring key


class WideStep(NamedTuple):
    """The per-step ring of a step with a long chunk (module docstring): sequence ``b``'s
    positions ``a[b] .. kv_len[b] - 1`` at rows ``base[b] + p % size`` with ``size`` past
    every position of the step (so ``base[b] + p``: the regions packed end to end, each
    exactly as long as it holds; ``base[b]`` may be negative); ``base`` / ``lo`` (= ``a``)
    int32 ``[num_seqs]`` on the device, ``lo_np`` on the host. The copy that fills it, int64
    on the device, one entry a region row: row ``to[i]`` takes the step's new row ``src[i]``
    (``>= 0``) or the ring's row ``-1 - src[i]``. ``layers``: the region tensors ``(k, v)``
    of the layer stored last (`fill`)."""

    size: int
    base: torch.Tensor
    lo: torch.Tensor
    lo_np: np.ndarray
    src: torch.Tensor
    to: torch.Tensor
    layers: dict

    def fill(self, layer: int, kv: RecentKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """``layer``'s regions from its ring (not yet written this step) and the step's new
        rows ``k`` / ``v`` ``[T, Hkv, D]`` (cast to the ring's dtype), by `copy_rows`. Drops
        the layer before's regions."""
        self.layers.clear()
        rk, rv = kv.k[layer], kv.v[layer]
        shape = (max(self.to.shape[0], 1), *rk.shape[1:])
        out_k, out_v = rk.new_empty(shape), rv.new_empty(shape)
        copy_rows(k, v, out_k, out_v, self.to, self.src, (rk, rv))
        self.layers[layer] = (out_k, out_v)


class RecentStep(NamedTuple):
    """One step's ring facts: ``base`` / ``lo`` int32 ``[num_seqs]`` (batch order), ``rows``
    int64 ``[num_tokens]`` (each token's ring row, the trash row where it is not kept), on
    the device; ``lo_np`` the bounds on the host; ``wide`` the per-step ring of a step with
    a long chunk (`WideStep`), else None."""

    kv: RecentKV
    base: torch.Tensor
    lo: torch.Tensor
    rows: torch.Tensor
    lo_np: np.ndarray
    wide: WideStep | None = None

    def overlay(
        self, layer: int, b: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s gathered keys and values ``[kv_len, Hkv, D]`` (positions 0 ..
        kv_len - 1) and its queries' visibility ``mask`` ``[q_len, kv_len]`` (the last
        ``q_len`` positions) with the ring's keys in: where every query has the same bound,
        the keys from ``lo[b]`` on replaced by the ring's (the torch path's `ring_overlay`,
        in ``k``'s dtype); else the ring's keys after the pages' (``[2 kv_len, ...]``) and the
        mask widened to match, each query seeing a key in one of the two."""
        kv_len, q_len = k.shape[0], mask.shape[0]
        lo_np = self.lo_np if self.wide is None else self.wide.lo_np
        one = int(lo_np[b]) >= kv_len - self.kv.window  # one bound for all its queries
        positions = torch.arange(kv_len, device=k.device)[None]
        q_pos = kv_len - q_len + torch.arange(q_len, device=k.device)[None]
        ok, ov, m = ring_keys(k[None].float(), v[None].float(), positions, q_pos, mask[None],
                              self.ring(layer, b, b + 1), one)  # fmt: skip
        return ok[0].to(k.dtype), ov[0].to(v.dtype), mask if one else m[0]

    def ring(self, layer: int, first: int = 0, last: int | None = None) -> RecentRing:
        """The `RecentRing` of ``layer`` for the sequences ``first .. last - 1``, each query
        bounded by its own window where ``lo`` allows (`RecentWindow.plan`); in a step with
        a long chunk the per-step ring (`WideStep`, filled by this layer's `store`)."""
        wide = self.wide
        if wide is None:
            return RecentRing(
                self.kv.k[layer], self.kv.v[layer], self.base[first:last], self.lo[first:last],
                self.kv.size, self.kv.window,
            )  # fmt: skip
        if layer not in wide.layers:
            raise RuntimeError(
                f"kv_exact_window: layer {layer}'s per-step ring is not filled; a step with a "
                "long chunk stores a layer's rows (RecentStep.store) before it attends"
            )
        k, v = wide.layers[layer]
        return RecentRing(k, v, wide.base[first:last], wide.lo[first:last], wide.size,
                          self.kv.window)  # fmt: skip

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's K / V rows ``[num_tokens, Hkv, D]`` into ``layer``'s rings (in a
        step with a long chunk, after filling the per-step ring from them and the ring)."""
        if self.wide is not None:
            self.wide.fill(layer, self.kv, k, v)
        self.kv.store(layer, k, v, self.rows)


class RecentKV:
    """The rings of every layer (module docstring).

    Args:
        num_layers, num_kv_heads, head_dim: the cache geometry.
        num_slots: sequences at once (the engine's ``max_num_seqs``).
        window: ``W``, positions read from the ring; slack: extra rows a sequence (drafts).
        dtype, device: the rings' (the attention's dtype: bf16 for a quantized cache).
    """

    def __init__(
        self, num_layers: int, num_slots: int, window: int, num_kv_heads: int, head_dim: int,
        *, slack: int = 0, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        for name, value, low in (("num_layers", num_layers, 1), ("num_slots", num_slots, 1),
                                 ("window", window, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("slack", slack, 0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.window = window
        self.size = window + slack
        self.num_slots = num_slots
        self.trash = num_slots * self.size
        shape = (self.trash + 1, num_kv_heads, head_dim)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """``k`` / ``v`` ``[T, Hkv, D]`` into ``layer``'s rings at ``rows`` (int64 ``[T]``;
        the trash row may repeat, every other row at most once), by `copy_rows`."""
        copy_rows(k, v, self.k[layer], self.v[layer], rows)


def copy_rows(
    k: torch.Tensor, v: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor,
    to: torch.Tensor, src: torch.Tensor | None = None,
    ring: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """Rows into ``out_k`` / ``out_v`` (``[rows, Hkv, D]``, contiguous) at ``to`` (int64
    ``[n]``), cast to their dtype: row ``i`` of ``k`` / ``v`` (``[T, Hkv, D]``, ``D``
    contiguous or not) with no ``src``; else the step's row ``src[i]`` where ``>= 0`` and the
    ``ring``'s row ``-1 - src[i]`` where not. One Triton launch for K and V
    (`ring_store_kernel`) on CUDA or with ``KVPLAN_FORCE_TRITON=1``, else index ops; the same
    values either way."""
    n = to.shape[0]
    if n == 0:
        return
    if use_triton(out_k) and k.stride(2) == 1 and v.stride(2) == 1:
        width = out_k.shape[1] * out_k.shape[2]
        tile = triton.next_power_of_2(width)
        rk, rv = ring if ring is not None else (out_k, out_v)
        ring_store_kernel[(n,)](
            k, v, out_k, out_v, to, to if src is None else src, rk, rv, k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), out_k.shape[2], width, TILE=tile,
            GATHER=src is not None, num_warps=4 if tile >= 1024 else 1,
        )  # fmt: skip
    elif src is None:
        out_k.index_copy_(0, to, k.to(out_k.dtype))
        out_v.index_copy_(0, to, v.to(out_v.dtype))
    else:
        old = src < 0
        new = ~old
        for out, rows, r in ((out_k, k, ring[0]), (out_v, v, ring[1])):
            out[to[old]] = r[-1 - src[old]]
            out[to[new]] = rows[src[new]].to(out.dtype)


@jit
def ring_store_kernel(
    k_ptr, v_ptr, out_k_ptr, out_v_ptr, to_ptr, src_ptr, rk_ptr, rv_ptr, stride_kt, stride_kh,
    stride_vt, stride_vh, head_dim, width, TILE: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """Grid ``(n,)``: row ``to[i]`` of ``out_k`` / ``out_v`` (``width = Hkv * D`` values a
    row, contiguous) from K / V row ``i`` (heads at their strides, ``D`` contiguous; cast to
    the output's dtype); with ``GATHER`` from row ``src[i]``, or where ``src[i] < 0`` from
    the ring's (``rk`` / ``rv``, contiguous, the output's dtype) row ``-1 - src[i]``."""
    i = tl.program_id(0).to(tl.int64)
    to = tl.load(to_ptr + i)
    offs = tl.arange(0, TILE)
    ok = offs < width
    dtype: tl.constexpr = out_k_ptr.dtype.element_ty
    if GATHER:
        src = tl.load(src_ptr + i)
    else:
        src = i
    if src < 0:
        kx = tl.load(rk_ptr + (-1 - src) * width + offs, mask=ok)
        vx = tl.load(rv_ptr + (-1 - src) * width + offs, mask=ok)
    else:
        h = offs // head_dim
        d = offs % head_dim
        kx = tl.load(k_ptr + src * stride_kt + h * stride_kh + d, mask=ok).to(dtype)
        vx = tl.load(v_ptr + src * stride_vt + h * stride_vh + d, mask=ok).to(dtype)
    tl.store(out_k_ptr + to * width + offs, kx, mask=ok)
    tl.store(out_v_ptr + to * width + offs, vx, mask=ok)


class RecentWindow:
    """Ring slots of the running requests and each step's `RecentStep` (module docstring).

    The step arrays live in persistent device buffers (``max_seqs`` / ``max_tokens`` long),
    written in place each step from two pinned host slots used in turn (the same discipline
    as the decode graphs' inputs), so a CUDA graph captured with one step's `RecentStep`
    reads every later step's values."""

    def __init__(self, kv: RecentKV, max_tokens: int, device: torch.device | str | None = None):
        self.kv = kv
        self._free = list(range(kv.num_slots - 1, -1, -1))
        self._slot: dict[Any, int] = {}
        self._start: dict[Any, int] = {}
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_tokens = max_tokens
        n = kv.num_slots
        self._base = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._lo = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._rows = torch.full((max_tokens,), kv.trash, dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda"
        self._staging = [
            (torch.zeros(n, dtype=torch.int32, pin_memory=pinned),
             torch.zeros(n, dtype=torch.int32, pin_memory=pinned),
             torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pinned))
            for _ in range(2)
        ]  # fmt: skip
        self._turn = 0

    def free(self, request_id: Any) -> None:
        """Release ``request_id``'s slot (a finished or preempted request; unknown ids pass)."""
        slot = self._slot.pop(request_id, None)
        self._start.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def pad(self, n: int, b: int) -> None:
        """Make rows ``n .. b - 1`` of a decode graph's bucket harmless: no ring key read
        (``lo`` past any ``kv_len``), their tokens' rows the trash row."""
        if b > n:
            self._lo[n:b].fill_(NO_RING)
            self._rows[n:b].fill_(self.kv.trash)

    def plan(
        self, request_ids: list[Any], num_cached: np.ndarray, num_query: np.ndarray,
    ) -> RecentStep:  # fmt: skip
        """The `RecentStep` of a step whose sequence ``b`` (batch order, its tokens
        contiguous) has ``num_cached[b]`` tokens before this step's ``num_query[b]``."""
        kv = self.kv
        n = len(request_ids)
        cached = np.asarray(num_cached, dtype=np.int64)[:n]
        query = np.asarray(num_query, dtype=np.int64)[:n]
        base = np.empty(n, dtype=np.int64)
        start = np.empty(n, dtype=np.int64)
        for b, rid in enumerate(request_ids):
            slot = self._slot.get(rid)
            if slot is None:
                if not self._free:
                    raise RuntimeError(
                        f"kv_exact_window: no free ring slot for request {rid!r} "
                        f"({kv.num_slots} slots, one per running request)"
                    )
                slot = self._slot[rid] = self._free.pop()
                self._start[rid] = int(cached[b])
            base[b] = slot * kv.size
            start[b] = self._start[rid]
        kv_len = cached + query
        # one bound for the step's queries (its last one's), except in steps short enough for
        # the ring to hold every query's own window (draft verification: 1 < query <= slack
        # + 1, after the first step): there the ring's content, each query bounded by itself
        lo = np.maximum(kv_len - kv.window, start)
        own = (cached > 0) & (query > 1) & (query <= kv.size - kv.window + 1)
        lo = np.where(own, np.maximum(kv_len - kv.size, start), lo)
        # a chunk whose first query's bound is below lo: the step takes a per-step ring
        first = np.maximum(cached - kv.window + 1, start)
        wide = None
        if ((query > 1) & (first < lo)).any():
            wide = self._wide(base, cached, query, kv_len, first)
        # each token's position; kept where it is among the sequence's last `size` positions
        total = int(query.sum())
        pos = new_token_positions(cached, exclusive_cumsum(query), query, np.arange(total))
        keep = pos >= np.repeat(kv_len, query) - kv.size
        rows = np.where(keep, np.repeat(base, query) + pos % kv.size, kv.trash)
        t = rows.size
        if t > self.max_tokens:
            raise ValueError(f"a step of {t} tokens exceeds the ring's {self.max_tokens}")
        h_base, h_lo, h_rows = self._staging[self._turn]
        self._turn ^= 1
        h_base.numpy()[:n] = base
        h_lo.numpy()[:n] = lo
        h_rows.numpy()[:t] = rows
        cuda = self.device.type == "cuda"
        self._base[:n].copy_(h_base[:n], non_blocking=cuda)
        self._lo[:n].copy_(h_lo[:n], non_blocking=cuda)
        self._rows[:t].copy_(h_rows[:t], non_blocking=cuda)
        return RecentStep(kv, self._base[:n], self._lo[:n], self._rows[:t], lo, wide)

    def _wide(self, base, cached, query, kv_len, first) -> WideStep:
        """The `WideStep` of a step: sequence ``b``'s region holds positions ``first[b] ..
        kv_len[b] - 1``, those below ``cached[b]`` from its ring slot (``base[b]``), the rest
        from the step's new rows (batch order, each sequence's tokens contiguous)."""
        kv, n = self.kv, cached.size
        spans = kv_len - first
        offsets = exclusive_cumsum(spans)
        rows = int(offsets[-1])
        region = offsets[:-1] - first  # row of position p: region[b] + p
        pos = new_token_positions(first, offsets, spans, np.arange(rows))
        seq = np.repeat(np.arange(n), spans)
        old = pos < cached[seq]
        new_row = exclusive_cumsum(query)[seq] + pos - cached[seq]
        src = np.where(old, -1 - (base[seq] + pos % kv.size), new_row)
        dev, i64 = self.device, torch.int64
        return WideStep(
            int(kv_len.max()) + 1, to_device(region, dev), to_device(first, dev), first,
            to_device(src, dev, i64), to_device(region[seq] + pos, dev, i64), {},
        )  # fmt: skip
