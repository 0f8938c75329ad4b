"""Paged row storage of the planned hybrid family: one KV cache tensor and its byte format.

Every write goes through ``kvplan.ops.store_kv_cache`` and every read through
``kvplan.ops.load_paged_kv_cache``; this module only chooses the format and converts rows
to and from what those ops take and return.

Formats (``kv_format`` of :class:`~kvplan.backends.hybrid.planned.PlannedHybridFamily`):

* ``"exact"``: rows keep the model dtype. ``store_kv_cache`` takes BF16 only, so an fp32 row
  of ``C`` values is stored bit for bit as ``bf16_format(2 * C)`` (its fp32 bytes viewed as
  ``2C`` BF16 halves; BF16 caches are byte copies) and viewed back as fp32 after the load; a
  BF16 model stores ``bf16_format(C)``.
* ``"fp8"``: main rows (SWA ring, compressed entries) e4m3 with one UE8M0 scale per 32 values,
  token-interleaved and dequantized on load (``V41_FORMAT`` itself when ``C == 512``); the
  indexer keys in an index layout (``index_format``: ``"mxfp8"`` = ``MXFP8_INDEX_KV_FORMAT``,
  ``"fp8_fp32sf"`` = ``FP8_FLOAT32_SF_INDEX_KV_FORMAT``, ``"fp4"`` = ``FP4_INDEX_KV_FORMAT``,
  themselves when ``C == 128``, the same layout at other widths).
* ``"fp4"``: main rows e2m1 with one e4m3 scale per 16 values (``V41_FP4_FORMAT`` layout);
  indexer keys as with ``"fp8"`` (default ``"fp4"``).

Quantized formats quantize the BF16 rounding of the row (``store_kv_cache``'s input).
"""

from __future__ import annotations

import math

import torch

from kvplan import quant
from kvplan._checks import check_range
from kvplan.formats import (
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
    V41_FORMAT,
    V41_FP4_FORMAT,
    KVCacheFormat,
    alloc_kv_cache,
    bf16_format,
)
from kvplan.ops import load_paged_kv_cache, store_kv_cache
from kvplan.ops._dispatch import use_triton
from kvplan.ops.sparse_attention import KeySource

KV_FORMATS = ("exact", "fp8", "fp4")
INDEX_FORMATS = ("mxfp8", "fp8_fp32sf", "fp4")

_MAIN = {"fp8": V41_FORMAT, "fp4": V41_FP4_FORMAT}
_INDEX = {
    "mxfp8": MXFP8_INDEX_KV_FORMAT,
    "fp8_fp32sf": FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    "fp4": FP4_INDEX_KV_FORMAT,
}


def _resized(base: KVCacheFormat, width: int, base_width: int) -> KVCacheFormat:
    """``base``'s layout at ``width`` elements (itself when ``width == base_width``). A format
    with one scale per row (``elements_per_sf == base_width``) keeps one scale per row."""
    if width == base_width:
        return base
    per_sf = width if base.elements_per_sf == base_width else base.elements_per_sf
    return KVCacheFormat(
        base.quantized_dtype, width, per_sf, 0, base.do_cast, base.sf_format,
        f"{base.note.split(':')[0]} layout at x{width}", base.token_interleaved,
    )  # fmt: skip


def exact_format(width: int, dtype: torch.dtype) -> KVCacheFormat:
    """The exact layout of a ``width``-wide row of ``dtype`` (see the module docstring)."""
    return bf16_format(width if dtype == torch.bfloat16 else 2 * width)


def main_format(kv_format: str, width: int, dtype: torch.dtype) -> KVCacheFormat:
    """Layout of the SWA ring and compressed entries for ``kv_format``."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "exact":
        return exact_format(width, dtype)
    return _resized(_MAIN[kv_format], width, 512)


def index_format(
    kv_format: str, index_kind: str | None, width: int, dtype: torch.dtype
) -> KVCacheFormat:
    """Layout of the indexer's compressed keys (``index_kind`` None: ``"mxfp8"`` for fp8,
    ``"fp4"`` for fp4; exact rows for ``"exact"``)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "exact":
        if index_kind is not None:
            raise ValueError(f"index_format={index_kind!r} needs a quantized kv_format")
        return exact_format(width, dtype)
    kind = index_kind or ("fp4" if kv_format == "fp4" else "mxfp8")
    if kind not in INDEX_FORMATS:
        raise ValueError(f"index_format must be one of {INDEX_FORMATS}, got {kind!r}")
    return _resized(_INDEX[kind], width, 128)


class PagedRows:
    """One paged cache of ``width``-wide rows: ``alloc_kv_cache(num_blocks, block_size,
    layout)``, slots ``block * block_size + offset``.

    ``store(rows, slots)`` / ``load(segments, total_k)`` / ``load_slots(slots)`` take and
    return float rows ``[n, width]`` (fp32 out; ``load`` and ``roundtrip`` also give the
    BF16 rows of a non-fp32 layout); ``roundtrip(rows)`` is what a store and a load give
    back (the quantize-dequantize of the format).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVCacheFormat,
        width: int,
        *,
        device: torch.device,
        check: bool = False,
    ) -> None:
        self.layout = layout
        self.width = width
        self.block_size = block_size
        self.check = check
        self.cache = alloc_kv_cache(num_blocks, block_size, layout, device=device)
        self.cache.zero_()
        self._scratch_buf: torch.Tensor | None = None  # `roundtrip`'s, grown on demand
        # fp32 rows carried as BF16 halves (exact layout of a non-BF16 model)
        self.fp32_bits = not layout.is_quantized and layout.bf16_elements == 2 * width

    def _to_cache_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.fp32_bits:
            return rows.to(torch.float32).contiguous().view(torch.bfloat16)
        return rows.to(torch.bfloat16).contiguous()

    def _from_loaded(self, out, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fp32_bits:
            return out.view(torch.float32)
        if self.layout.do_cast or not self.layout.is_quantized:
            return out.to(dtype)
        return dequantize_index(out, self.layout).to(dtype)

    def store(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``rows [n, width]`` into ``slots`` (int32 ``[n]``, -1 skips).

        fp32 rows carried as BF16 halves are checked as fp32 values (their halves may spell a
        BF16 NaN): with ``check``, a non-finite value or a slot outside the cache raises
        ``ValueError`` before anything is written, then the halves are copied unchecked.
        """
        self.store_into(self.cache, rows, slots)

    def store_into(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """`store` into ``cache``, another tensor of this layout (``[n, block_size, ...]``,
        e.g. a snapshot of this cache's blocks): the same bytes ``store`` writes."""
        check = self.check
        if self.fp32_bits and check:
            if not bool(torch.isfinite(rows).all()):
                raise ValueError("rows hold a non-finite value (inf or NaN)")
            check_range("slots", slots, -1, cache.shape[0] * cache.shape[1])
            check = False
        store_kv_cache(self._to_cache_rows(rows), cache, slots, layout=self.layout,
                       check=check)  # fmt: skip

    def load(
        self, segments: torch.Tensor, total_k: int, *, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``[total_k, width]`` loaded by a load plan (zero rows for ``-1`` blocks), as fp32
        or, with ``dtype=torch.bfloat16``, as the BF16 the load produces (the same values:
        every loaded row is BF16-exact) -- except fp32 rows, which stay fp32."""
        out = load_paged_kv_cache(self.cache, segments, total_k, layout=self.layout,
                                  check=self.check)  # fmt: skip
        return self._from_loaded(out, dtype)

    def load_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, width]``: row ``i`` is slot ``slots[i]`` (zeros for ``-1``), loaded by
        a plan of one segment per slot built on the device."""
        flat = slots.reshape(-1).to(torch.int32)
        return self.load(slot_segments(flat, self.block_size), flat.shape[0])

    def key_source(self, slots: torch.Tensor) -> KeySource:
        """This cache read in place by ``kvplan.ops.sparse_attention`` through the int32 slot
        table ``slots [T, K]`` (rows as ``load_slots`` would return them). Quantized layouts
        keep the uint8 cache; exact ones view it as fp32 / bf16 rows."""
        if self.layout.is_quantized:
            return KeySource(self.cache, slots, self.layout)
        return KeySource(
            self.cache.view(torch.float32 if self.fp32_bits else torch.bfloat16), slots
        )

    def _scratch(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """`roundtrip`'s scratch cache of ``num_blocks`` blocks: the first blocks of one
        buffer kept for the largest request so far (stream-ordered reuse: each roundtrip's
        load has read it before the next one's store writes it)."""
        buf = self._scratch_buf
        if buf is None or buf.shape[0] < num_blocks or buf.device != device:
            buf = alloc_kv_cache(num_blocks, self.block_size, self.layout, device=device)
            self._scratch_buf = buf
        return buf[:num_blocks]

    def roundtrip(self, rows: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows as ``store`` + ``load(dtype=dtype)`` would return them (this cache is not
        touched). Quantized layouts on the ops' Triton path: the fused store and load kernels
        through a scratch cache of ``rows``' size (two launches instead of the torch quantize
        and dequantize ops; the same bits)."""
        x = self._to_cache_rows(rows)
        if self.fp32_bits:
            return x.view(torch.float32)
        if not self.layout.is_quantized:
            return x.to(dtype)
        if use_triton(x) and x.shape[0]:
            n, bs = x.shape[0], self.block_size
            scratch = self._scratch(-(-n // bs), x.device)
            slots, segs = _roundtrip_plan(n, bs, x.device)
            store_kv_cache(x, scratch, slots, layout=self.layout, check=False)
            return self._from_loaded(
                load_paged_kv_cache(scratch, segs, n, layout=self.layout, check=False), dtype
            )
        values, scales = quant.quantize(x.reshape(x.shape[0], -1), self.layout)
        return quant.dequantize(values, scales, self.layout).to(dtype)


_PLANS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_PLANS = 64


def _roundtrip_plan(n: int, block_size: int, device: torch.device):
    """(int32 slots ``0 .. n - 1``, `block_segments` of them) for `PagedRows.roundtrip`,
    cached per (n, block size, device): every layer of a step asks for the same ones.
    Read-only tensors; the cache is cleared once it holds ``_MAX_PLANS`` sizes."""
    key = (n, block_size, device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        slots = torch.arange(n, dtype=torch.int32, device=device)
        plan = _PLANS[key] = (slots, block_segments(n, block_size, device))
    return plan


def block_segments(n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """int32 ``[ceil(n / block_size), 4]`` load plan of slots ``0 .. n - 1`` in order: one
    segment per whole block (the last one partial), so the load kernel walks full blocks
    instead of one row per program as `slot_segments` would.

    >>> block_segments(7, 4, torch.device("cpu")).tolist()
    [[0, 0, 4, 0], [1, 0, 3, 4]]
    """
    start = torch.arange(0, n, block_size, dtype=torch.int32, device=device)
    block = start // block_size
    end = torch.clamp(n - start, max=block_size)
    return torch.stack([block, torch.zeros_like(block), end, start], dim=1).to(torch.int32)


def slot_segments(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 ``[n, 4]`` load plan of one segment per slot of int32 ``slots [n]`` (row ``i``
    gets slot ``slots[i]``; ``-1`` loads nothing), built on the slots' device."""
    live = slots >= 0
    offset = torch.where(live, slots % block_size, 0)
    rows = torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device)
    block = torch.where(live, slots // block_size, -1)
    return torch.stack([block, offset, offset + 1, rows], dim=1).to(torch.int32)


def dequantize_index(loaded, layout: KVCacheFormat) -> torch.Tensor:
    """BF16 ``[n, elements]`` from ``load_paged_kv_cache``'s raw output of an index layout
    (``LoadedIndexKV``: values plus UE8M0 scales packed 4 per int32, or fp32 / e4m3 scales)."""
    values, scales = loaded
    n = values.shape[0]
    # row widths from the shapes, not inferred with -1: a load of zero rows is a valid call
    v = values.view(torch.uint8).reshape(n, layout.quantized_bytes)
    s_row = scales.element_size() * math.prod(scales.shape[1:])  # UE8M0: int32s, zero padded
    s = scales.contiguous().view(torch.uint8).reshape(n, s_row)[:, : layout.sf_bytes]
    return quant.dequantize(v, s.contiguous(), layout)
