"""Per-layer K and V cache tensors addressed by the manager's block ids.

Layouts (``H`` = num_kv_heads, ``D`` = head_dim, slot = block * block_size + offset):

* ``"bf16"``: ``k_cache(layer)`` / ``v_cache(layer)`` are bfloat16 ``[num_blocks, block_size,
  H, D]`` views of a uint8 cache from ``kvplan.alloc_kv_cache(..., bf16_format(H * D))`` (the
  raw cache is ``raw_k_cache(layer)``).
* ``"fp16"`` / ``"fp32"``: plain ``[num_blocks, block_size, H, D]`` tensors of that dtype.
* quantized formats (``QUANTIZED_KV_FORMATS``): uint8 ``[num_blocks, block_size, 1,
  bytes_per_token]`` caches of the token-interleaved, cast-on-load format ``layout`` over
  H * D elements:

  - ``"fp8"``: e4m3 values, one fp32 scale per 32 values, searched (``layout.scale_search``:
    the best of ``amax / c`` for the nine e4m3 values ``c`` in [224, 448]; every group's largest
    value is stored exactly, and the search also puts the next largest on the grid where a scale
    can).
  - ``"int8"``: symmetric int8 values (-127..127, round half to even), one fp32 scale per 32
    values (``amax / 127``); same record size as ``"fp8"``.
  - ``"fp4"``: e2m1 values (two per byte, element 2i in the low nibble), one e4m3 scale per
    16 values, searched among the code of ``kvplan.V41_FP4_FORMAT``'s rule and its neighbours
    (``kvplan.quant``).

  Every head's D values are whole scale groups (``D % group == 0``): a token's record is the
  H heads' value runs, then the H heads' scale runs. ``read_blocks`` dequantizes to bfloat16;
  the paged attention kernels read the raw caches in place (``raw_k_cache`` + ``layout``).

Caches are zero-initialized so the padding block 0 (and unwritten slots) reads as zeros.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvplan._checks import check_int32, check_range, check_tensor
from kvplan.ops._dispatch import use_triton

_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# kv_format -> (quantized_dtype, elements_per_sf, sf_format) of the quantized caches
QUANTIZED_KV_FORMATS = {
    "fp8": ("e4m3", 32, "fp32"),
    "int8": ("int8", 32, "fp32"),
    "fp4": ("e2m1", 16, "e4m3"),
}
# kv_formats whose writers search the scales (kvplan.quant); `KVPLAN_KV_SCALE_SEARCH=0` in
# the environment turns it off for caches built afterwards (the plain rules; A/B runs)
SEARCHED_SCALES = frozenset({"fp8", "fp4"})


def _searches_scales(kv_format: str) -> bool:
    return kv_format in SEARCHED_SCALES and os.environ.get("KVPLAN_KV_SCALE_SEARCH", "1") != "0"


KV_FORMATS = ("bf16", "fp16", "fp32", *QUANTIZED_KV_FORMATS)


def kv_bytes_per_value(kv_format: str) -> float:
    """Cache bytes per stored K or V value of ``kv_format`` (scales included)."""
    if kv_format in QUANTIZED_KV_FORMATS:
        dtype, group, sf = QUANTIZED_KV_FORMATS[kv_format]
        return (0.5 if dtype == "e2m1" else 1.0) + (4 if sf == "fp32" else 1) / group
    if kv_format not in _PLAIN_DTYPES:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    return float(_PLAIN_DTYPES[kv_format].itemsize)


class KVCacheTensors:
    """K and V caches for ``num_layers`` layers.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: cache geometry
            (``num_blocks`` includes the padding block 0). ``num_blocks`` is one int for every
            layer or one per layer (a layer's caches hold its pool's blocks: sliding-window
            pools are smaller, ``kvplan.cache.pool_sizing``).
        kv_format: one of ``KV_FORMATS`` (see the module docstring).
        device: where the caches live (default CPU).

    Example::

        kv = KVCacheTensors(2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=64)
        kv.store(0, k, v, torch.tensor([4, 5, -1]))   # k, v: [3, 2, 64]; row 2 skipped
        kv.k_cache(0)[1, 0]                            # == k[0] (slot 4 = block 1, offset 0)
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int | Sequence[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        kv_format: str = "bf16",
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        per_layer = _per_layer_blocks(num_layers, num_blocks)
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        group = QUANTIZED_KV_FORMATS.get(kv_format, (None, 1, None))[1]
        if head_dim % group:
            raise ValueError(
                f"kv_format {kv_format!r} needs head_dim % {group} == 0, got head_dim {head_dim}"
            )
        check_int32("num_blocks * block_size", max(per_layer) * block_size)
        self.num_layers = num_layers
        self.num_blocks_per_layer = per_layer
        self.num_blocks = max(per_layer)  # the largest layer's; ``num_blocks_of`` per layer
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_format = kv_format
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.layout = self._make_layout()
        self._raw: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._alloc(n), self._alloc(n)) for n in per_layer
        ]
        self._views = [(self._typed(k), self._typed(v)) for k, v in self._raw]

    # ------------------------------------------------------------------ properties
    @property
    def is_quantized(self) -> bool:
        return self.kv_format in QUANTIZED_KV_FORMATS

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the values read back (quantized formats dequantize to bfloat16)."""
        return torch.bfloat16 if self.is_quantized else _PLAIN_DTYPES[self.kv_format]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_of(self, layer: int) -> int:
        """Blocks in layer ``layer``'s caches (its pool's count, padding block 0 included)."""
        return self.num_blocks_per_layer[self._check_layer(layer)]

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache (see the module docstring for its shape and dtype)."""
        return self._views[self._check_layer(layer)][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._views[self._check_layer(layer)][1]

    def raw_k_cache(self, layer: int) -> torch.Tensor:
        """The allocation behind ``k_cache`` (uint8 for bf16 and the quantized formats)."""
        return self._raw[self._check_layer(layer)][0]

    def raw_v_cache(self, layer: int) -> torch.Tensor:
        return self._raw[self._check_layer(layer)][1]

    # ------------------------------------------------------------------ store / read
    def store(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        check: bool = True,
    ) -> None:
        """Write ``k[i]``, ``v[i]`` (``[T, H, D]``, any float dtype) at ``slot_mapping[i]``.

        ``slot_mapping``: int32/int64 ``[T]`` on the caches' device; ``-1`` skips the row.
        Values are cast to the cache dtype (round to nearest even). bf16 and the quantized
        formats go through ``kvplan.store_kv_cache`` (Triton on CUDA; ``kvplan.quant`` rules);
        fp16/fp32 use a sync-free torch scatter. Rows sharing a slot leave one of them
        (unspecified which; such rows are padding by contract). ``check`` validates the slot
        range (one reduction; a device sync on CUDA).
        """
        self._check_layer(layer)
        t = slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) else None
        shape = (t, self.num_kv_heads, self.head_dim)
        check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
        check_tensor("k", k, shape=shape, device=self.device)
        check_tensor("v", v, shape=shape, device=self.device)
        check_tensor("slot_mapping", slot_mapping, device=self.device)
        if check:
            check_range(
                "slot_mapping", slot_mapping, -1, self.num_blocks_of(layer) * self.block_size
            )
        if self.layout is not None:  # bf16 and quantized: the storage layer's store
            from kvplan.ops.store import store_kv_cache

            raw_k, raw_v = self._raw[layer]
            slots = self._int32_slots(slot_mapping, layer)
            for x, raw in ((k, raw_k), (v, raw_v)):
                store_kv_cache(x.to(torch.bfloat16), raw, slots, layout=self.layout, check=False)
            return
        if slot_mapping.device.type == "cpu":  # no sync to avoid: write the kept rows only
            live = slot_mapping >= 0
            rows = None if bool(live.all()) else live.nonzero().squeeze(1)
            slots = slot_mapping.long() if rows is None else slot_mapping[rows].long()
            for x, cache in zip((k, v), self._views[layer]):
                flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [N*bs, H, D]
                flat.index_put_((slots,), (x if rows is None else x[rows]).to(flat.dtype))
            return
        # Sync-free (CUDA-graph safe) scatter: a skipped row targets slot 0 (padding block 0)
        # and writes back the value already there, so it changes nothing.
        keep = (slot_mapping >= 0)[:, None, None]  # [T, 1, 1]
        slots = slot_mapping.long().clamp(min=0)  # [T]
        for x, cache in zip((k, v), self._views[layer]):
            flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [N*bs, H, D]
            flat.index_put_((slots,), torch.where(keep, x.to(flat.dtype), flat[slots]))

    def read_blocks(
        self, layer: int, block_ids: torch.Tensor, *, check: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks in compute dtype: ``[n, block_size, H, D]`` each.

        ``block_ids``: int ``[n]`` on the caches' device. Quantized values are dequantized
        (value times its group's scale, ``kvplan.quant.dequantize``) to bfloat16. ``check`` validates
        the id range (one reduction; a device sync on CUDA).
        """
        check_tensor("block_ids", block_ids, dtype=(torch.int32, torch.int64), ndim=1)
        if check:
            check_range("block_ids", block_ids, 0, self.num_blocks_of(layer))
        idx = block_ids.long()
        k_cache, v_cache = self.k_cache(layer), self.v_cache(layer)
        if not self.is_quantized:
            return k_cache[idx], v_cache[idx]
        return self._dequant(k_cache[idx]), self._dequant(v_cache[idx])

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V stored at ``slots`` (int ``[n]``, each in ``[0, num_slots)`` or -1 for a
        row of zeros, on the caches' device; not checked: no sync) as ``[n, H, D]`` in compute
        dtype: quantized values dequantized to bfloat16 (``kvplan.quant.dequantize``, the
        values the paged kernels read). Quantized caches on CUDA: one Triton launch per cache
        (``kvplan.ops.read_slots``); else a gather per cache (plus the torch
        dequantization)."""
        check_tensor("slots", slots, dtype=(torch.int32, torch.int64), ndim=1)
        k_cache, v_cache = self._raw[self._check_layer(layer)]
        if self.is_quantized and use_triton(k_cache):
            from kvplan.ops.read_slots import read_slots_triton

            return tuple(
                read_slots_triton(c, slots, self.layout, self.head_dim) for c in (k_cache, v_cache)
            )
        stored = slots >= 0
        idx = slots.long().clamp(min=0)
        block, offset = idx // self.block_size, idx % self.block_size
        if not self.is_quantized:
            k, v = self.k_cache(layer)[block, offset], self.v_cache(layer)[block, offset]
        else:
            # [n, 1, 1, bytes]: indexing (block, offset) gathers the records without a copy of
            # the cache (its blocks may be padded, so a flat view of it would be one)
            rows = [c[block, offset].unsqueeze(1) for c in (k_cache, v_cache)]
            k, v = (self._dequant(r).squeeze(1) for r in rows)
        keep = stored[:, None, None]
        return torch.where(keep, k, 0), torch.where(keep, v, 0)

    # ------------------------------------------------------------------ internals
    def _int32_slots(self, slot_mapping: torch.Tensor, layer: int) -> torch.Tensor:
        """``slot_mapping`` as int32, converted once per forward: the layers of a step store in
        increasing order through the same slot tensor, so a later layer reuses the first one's
        conversion (same object, same in-place version counter, a higher layer). A lower or
        equal layer starts a new step and converts again, so a slot tensor rewritten between
        steps (e.g. by a kernel, which does not bump the version) is never read stale; a CUDA
        graph replays the conversion where its first layer recorded it."""
        if slot_mapping.dtype == torch.int32:
            return slot_mapping
        memo = getattr(self, "_slots_memo", None)
        if (
            memo is not None
            and memo[0] is slot_mapping
            and memo[1] == slot_mapping._version
            and layer > memo[2]
        ):
            self._slots_memo = (memo[0], memo[1], layer, memo[3])
            return memo[3]
        slots = slot_mapping.to(torch.int32)
        self._slots_memo = (slot_mapping, slot_mapping._version, layer, slots)
        return slots

    def _make_layout(self):
        from kvplan.formats import KVCacheFormat, bf16_format

        hd = self.num_kv_heads * self.head_dim
        if self.kv_format == "bf16":
            return bf16_format(hd)
        if self.is_quantized:
            dtype, group, sf = QUANTIZED_KV_FORMATS[self.kv_format]
            return KVCacheFormat(
                quantized_dtype=dtype,
                quantized_elements=hd,
                elements_per_sf=group,
                bf16_elements=0,
                do_cast=True,
                sf_format=sf,
                note=f"kvplan {self.kv_format} KV: {dtype} x{hd} (per-head records), {sf} per "
                f"{group}",
                token_interleaved=True,
                scale_search=_searches_scales(self.kv_format),
            )
        return None

    def _alloc(self, num_blocks: int) -> torch.Tensor:
        if self.layout is None:
            shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            return torch.zeros(shape, dtype=_PLAIN_DTYPES[self.kv_format], device=self.device)
        from kvplan.formats import alloc_kv_cache

        raw = alloc_kv_cache(num_blocks, self.block_size, self.layout, device=self.device)
        # alloc_kv_cache leaves the bytes uninitialized; zero the whole storage (padding too).
        torch.as_strided(raw, (raw.untyped_storage().nbytes(),), (1,), 0).zero_()
        return raw

    def _typed(self, raw: torch.Tensor) -> torch.Tensor:
        if self.kv_format != "bf16":
            return raw
        # raw: uint8 [N, bs, 1, 2*H*D] -> bfloat16 [N, bs, 1, H*D] -> [N, bs, H, D]
        return raw.view(torch.bfloat16).squeeze(2).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def _dequant(self, raw: torch.Tensor) -> torch.Tensor:
        # raw: uint8 [n, bs, 1, bytes_per_token], token-interleaved records:
        # quantized_bytes value bytes, then sf_bytes scale bytes
        from kvplan import quant

        n, bs = raw.shape[0], raw.shape[1]
        nv = self.layout.quantized_bytes
        records = raw.reshape(n * bs, -1)  # [n*bs, bytes_per_token]
        out = quant.dequantize(records[:, :nv], records[:, nv:], self.layout)  # [n*bs, HD] bf16
        return out.view(n, bs, self.num_kv_heads, self.head_dim)

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        return layer


def _per_layer_blocks(num_layers: int, num_blocks: int | Sequence[int]) -> tuple[int, ...]:
    """``num_blocks`` as one positive int per layer; ValueError naming the bad entry."""
    if not isinstance(num_blocks, Sequence):
        named = [("num_blocks", num_blocks)] * num_layers
    elif len(num_blocks) != num_layers:
        raise ValueError(f"num_blocks has {len(num_blocks)} entries for num_layers = {num_layers}")
    else:
        named = [(f"num_blocks[{i}]", n) for i, n in enumerate(num_blocks)]
    for name, value in named:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return tuple(n for _, n in named)
