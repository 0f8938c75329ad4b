"""KV cache byte formats: the ``KVCacheFormat`` descriptor, the supported formats, allocation,
value/scale views and format inference.

One token of one layer occupies ``bytes_per_token`` bytes of a uint8 cache viewed as
``[num_blocks, block_size, 1, bytes_per_token]``. Inside a block the bytes are laid out in one
of two ways::

    token-interleaved (main / SWA caches, do_cast=True):
        | values t0 | scales t0 | values t1 | scales t1 | ... | padding to block_stride |
    split (index caches):
        | values t0 | values t1 | ... | scales t0 | scales t1 | ... | padding |

The block stride is rounded up to ``lcm(32, bytes_per_token)`` bytes for token-interleaved
formats and to 32 bytes otherwise, so every block starts 32-byte aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from kvplan._checks import check_int32

QuantizedFormat = Literal["e4m3", "e2m1", "int8"]
ScaleFactorFormat = Literal["ue8m0", "e4m3", "fp32"]

_SF_BYTES = {"ue8m0": 1, "e4m3": 1, "fp32": 4}


@dataclass(frozen=True)
class KVCacheFormat:
    """How one token's KV record is stored.

    Fields:
        quantized_dtype: ``"e4m3"`` (8 bit), ``"int8"`` (symmetric two's-complement, codes
            -127..127, ``"fp32"`` scales only), ``"e2m1"`` (4 bit, two per byte, element 2i in
            the low nibble) or ``None`` for a plain BF16 cache.
        quantized_elements: logical quantized elements per token (not bytes).
        elements_per_sf: elements sharing one scale factor (the last group may be shorter).
        bf16_elements: BF16 elements per token; only for unquantized formats (mixing is refused).
        do_cast: ``load_paged_kv_cache`` dequantizes to BF16 (main caches) instead of returning
            raw values and scales (index caches).
        sf_format: ``"ue8m0"`` (power-of-two exponent byte), ``"e4m3"`` or ``"fp32"``.
        note: free-form description.
        token_interleaved: values and scales of a token are adjacent (see module docstring).
        scale_search: how a writer picks each group's scale (readers ignore it): the plain
            rule when False; when True the candidate scale whose rounding error on the group's
            large values is least (`kvplan.quant`, "Searched scales"): ``e4m3`` values with
            ``fp32`` scales (the nine ``amax / c``, ``c`` the e4m3 values in [224, 448]) or
            ``e2m1`` values with ``e4m3`` scales (the plain code and its neighbours); groups
            of at most 64 values.

    Validation (``ValueError`` naming the field): an unquantized format has no quantized
    elements, groups or scale format and at least one BF16 element; a quantized one has positive
    element and group counts, a scale format and no BF16 elements; ``e2m1`` needs even element
    and group counts (a packed byte never straddles two groups); ``do_cast`` needs
    ``token_interleaved``.
    """

    quantized_dtype: QuantizedFormat | None
    quantized_elements: int
    elements_per_sf: int
    bf16_elements: int
    do_cast: bool
    sf_format: ScaleFactorFormat | None
    note: str = ""
    token_interleaved: bool = False
    scale_search: bool = False

    def __post_init__(self) -> None:
        for name in ("quantized_elements", "elements_per_sf", "bf16_elements"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVCacheFormat.{name} must be a non-negative int, got {value!r}")
        if self.quantized_dtype is None:
            if self.quantized_elements != 0:
                raise ValueError(
                    "KVCacheFormat.quantized_elements must be 0 without quantized_dtype, "
                    f"got {self.quantized_elements}"
                )
            if self.elements_per_sf != 0:
                raise ValueError(
                    "KVCacheFormat.elements_per_sf must be 0 without quantized_dtype, "
                    f"got {self.elements_per_sf}"
                )
            if self.sf_format is not None:
                raise ValueError(
                    f"KVCacheFormat.sf_format must be None without quantized_dtype, "
                    f"got {self.sf_format!r}"
                )
            if self.bf16_elements <= 0:
                raise ValueError(
                    f"KVCacheFormat.bf16_elements must be > 0 for a BF16 format, "
                    f"got {self.bf16_elements}"
                )
        else:
            if self.quantized_dtype not in ("e4m3", "e2m1", "int8"):
                raise ValueError(
                    f"KVCacheFormat.quantized_dtype must be 'e4m3', 'e2m1', 'int8' or None, "
                    f"got {self.quantized_dtype!r}"
                )
            if self.quantized_elements <= 0:
                raise ValueError(
                    f"KVCacheFormat.quantized_elements must be > 0, got {self.quantized_elements}"
                )
            if self.elements_per_sf <= 0:
                raise ValueError(
                    f"KVCacheFormat.elements_per_sf must be > 0, got {self.elements_per_sf}"
                )
            if self.sf_format not in _SF_BYTES:
                raise ValueError(
                    "KVCacheFormat.sf_format must be 'ue8m0', 'e4m3' or 'fp32', "
                    f"got {self.sf_format!r}"
                )
            if self.quantized_dtype == "int8" and self.sf_format != "fp32":
                raise ValueError(
                    f"KVCacheFormat.sf_format must be 'fp32' for int8, got {self.sf_format!r}"
                )
            if self.bf16_elements:
                raise ValueError(
                    "KVCacheFormat.bf16_elements: mixed quantized/BF16 KV caches are not "
                    f"supported, got {self.bf16_elements}"
                )
            if self.quantized_dtype == "e2m1":
                if self.quantized_elements % 2:
                    raise ValueError(
                        "KVCacheFormat.quantized_elements must be even for e2m1, "
                        f"got {self.quantized_elements}"
                    )
                if self.elements_per_sf % 2:
                    raise ValueError(
                        "KVCacheFormat.elements_per_sf must be even for e2m1, "
                        f"got {self.elements_per_sf}"
                    )
        if self.scale_search is not False and (
            self.scale_search is not True
            or (self.quantized_dtype, self.sf_format) not in (("e4m3", "fp32"), ("e2m1", "e4m3"))
            or self.elements_per_sf > 64
        ):
            raise ValueError(
                "KVCacheFormat.scale_search must be a bool, True only for e4m3 values with fp32 "
                "scales or e2m1 values with e4m3 scales, groups of at most 64 values; got "
                f"{self.scale_search!r} with {self.quantized_dtype!r} / {self.sf_format!r} / "
                f"{self.elements_per_sf}"
            )
        if self.do_cast and not self.token_interleaved:
            raise ValueError(
                "KVCacheFormat.token_interleaved must be True when do_cast=True "
                "(main/SWA caches are token-interleaved)"
            )

    @property
    def is_quantized(self) -> bool:
        return self.quantized_dtype is not None

    @property
    def quantized_bytes(self) -> int:
        """Bytes of quantized values per token (FP4: two elements per byte)."""
        if self.quantized_dtype is None:
            return 0
        bits = 4 if self.quantized_dtype == "e2m1" else 8
        return self.quantized_elements * bits // 8

    @property
    def num_scales(self) -> int:
        """Scale factors per token: ceil(quantized_elements / elements_per_sf)."""
        if self.quantized_dtype is None:
            return 0
        return -(-self.quantized_elements // self.elements_per_sf)

    @property
    def sf_bytes(self) -> int:
        """Bytes of scale factors per token."""
        if self.sf_format is None:
            return 0
        return self.num_scales * _SF_BYTES[self.sf_format]

    @property
    def value_bytes(self) -> int:
        """Bytes of the value part of a record (quantized values or BF16 elements)."""
        return self.quantized_bytes + self.bf16_elements * torch.bfloat16.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.value_bytes + self.sf_bytes

    @property
    def elements(self) -> int:
        """Logical elements per token (what ``store_kv_cache`` takes and a cast load returns)."""
        return self.quantized_elements + self.bf16_elements

    @property
    def stride_alignment(self) -> int:
        """Guaranteed byte alignment of a token record: gcd(32, bytes_per_token) when
        token-interleaved, else 32 (the block alignment)."""
        if self.token_interleaved:
            return math.gcd(32, self.bytes_per_token)
        return 32

    @property
    def block_alignment(self) -> int:
        """Block strides are multiples of this many bytes."""
        if self.token_interleaved:
            return math.lcm(32, self.bytes_per_token)
        return 32

    def block_stride(self, block_size: int) -> int:
        """Bytes between consecutive blocks of ``block_size`` tokens."""
        align = self.block_alignment
        return -(-block_size * self.bytes_per_token // align) * align


V41_FORMAT = KVCacheFormat(
    "e4m3", 512, 32, 0, True, "ue8m0", "V4.1 main/SWA cache: FP8 x512, UE8M0 per 32", True
)
V41_FP4_FORMAT = KVCacheFormat(
    "e2m1", 512, 16, 0, True, "e4m3", "V4.1 FP4 main cache: FP4 x512, e4m3 per 16", True
)
FP4_INDEX_KV_FORMAT = KVCacheFormat(
    "e2m1", 128, 32, 0, False, "ue8m0", "V4/V4.1 index cache: FP4 x128, UE8M0 per 32"
)
FP8_FLOAT32_SF_INDEX_KV_FORMAT = KVCacheFormat(
    "e4m3", 128, 128, 0, False, "fp32", "V4 index cache: FP8 x128, one fp32 scale"
)
MXFP8_INDEX_KV_FORMAT = KVCacheFormat(
    "e4m3", 128, 32, 0, False, "ue8m0", "V4.1 index cache: FP8 x128, UE8M0 per 32"
)
SUPPORTED_KV_CACHE_FORMATS: tuple[KVCacheFormat, ...] = (
    V41_FORMAT,
    V41_FP4_FORMAT,
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
)


def bf16_format(num_elements: int) -> KVCacheFormat:
    """A plain BF16 cache of ``num_elements`` elements per token (split layout, no scales)."""
    if not isinstance(num_elements, int) or isinstance(num_elements, bool) or num_elements <= 0:
        raise ValueError(f"num_elements must be a positive int, got {num_elements!r}")
    return KVCacheFormat(None, 0, 0, num_elements, False, None, f"BF16 x{num_elements}")


def alloc_kv_cache(
    num_blocks: int,
    block_size: int,
    layout: KVCacheFormat,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Allocate an uninitialized cache: uint8 ``[num_blocks, block_size, 1, bytes_per_token]``.

    The view has strides ``(block_stride, bytes_per_token, bytes_per_token, 1)``; block_stride
    follows :meth:`KVCacheFormat.block_stride`. Example: V41_FORMAT with block_size 133 has
    133 * 528 = 70224 bytes per block, rounded up to 67 * 1056 = 70752.
    """
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"layout must be a KVCacheFormat, got {type(layout).__name__}")
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_int32("num_blocks * block_size", num_blocks * block_size)
    bpt = layout.bytes_per_token
    stride = layout.block_stride(block_size)
    storage = torch.empty((num_blocks, stride), dtype=torch.uint8, device=device)
    return storage.as_strided((num_blocks, block_size, 1, bpt), (stride, bpt, bpt, 1))


class KVCacheViews(NamedTuple):
    """Typed views of a cache's values and scales (they alias the cache).

    values: ``[num_blocks, block_size, value_width]`` -- float8_e4m3fn (e4m3), int8, float4_e2m1fn_x2
        (e2m1, width = elements / 2) or bfloat16 (BF16 formats).
    scales: ``[num_blocks, block_size, num_scales]`` -- uint8 (ue8m0 exponent bytes),
        float8_e4m3fn, or float32 (uint8 ``[.., sf_bytes]`` when the fp32 scales are not 4-byte
        aligned); ``None`` for BF16 formats.
    """

    values: torch.Tensor
    scales: torch.Tensor | None

    @property
    def value_element_strides(self) -> tuple[int, ...]:
        """Strides in logical elements: FP4 packs two elements per byte, so its strides are
        twice the byte strides."""
        if self.values.dtype == torch.float4_e2m1fn_x2:
            return tuple(2 * s for s in self.values.stride())
        return tuple(self.values.stride())


def _typed_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View uint8 ``t`` as ``dtype`` when sizes, strides and offset allow it, else return ``t``."""
    size = dtype.itemsize
    if size == 1:
        return t.view(dtype)
    ok = (
        t.shape[-1] % size == 0
        and t.storage_offset() % size == 0
        and all(s % size == 0 for s in t.stride()[:-1])
    )
    return t.view(dtype) if ok else t


def split_kv_cache(kv_cache: torch.Tensor, layout: KVCacheFormat | None = None) -> KVCacheViews:
    """Split a cache into value and scale views (see :class:`KVCacheViews`).

    Token-interleaved: values at byte ``[0, value_bytes)`` of each record, scales right after.
    Split layout: a block holds ``block_size * value_bytes`` value bytes, then the scales.
    """
    layout = resolve_kv_cache_layout(kv_cache, layout)
    raw = _as_bytes(kv_cache)
    num_blocks, block_size, _, bpt = raw.shape
    block_stride = raw.stride(0)
    vb, sb = layout.value_bytes, layout.sf_bytes
    base = raw.storage_offset()
    if layout.token_interleaved:
        v_strides, v_off = (block_stride, bpt, 1), base
        s_strides, s_off = (block_stride, bpt, 1), base + vb
    else:
        v_strides, v_off = (block_stride, vb, 1), base
        s_strides, s_off = (block_stride, sb, 1), base + block_size * vb
    values = raw.as_strided((num_blocks, block_size, vb), v_strides, v_off)
    if layout.quantized_dtype == "e4m3":
        values = values.view(torch.float8_e4m3fn)
    elif layout.quantized_dtype == "int8":
        values = values.view(torch.int8)
    elif layout.quantized_dtype == "e2m1":
        values = values.view(torch.float4_e2m1fn_x2)
    else:
        values = _typed_view(values, torch.bfloat16)
    if not layout.is_quantized:
        return KVCacheViews(values, None)
    scales = raw.as_strided((num_blocks, block_size, sb), s_strides, s_off)
    if layout.sf_format == "e4m3":
        scales = scales.view(torch.float8_e4m3fn)
    elif layout.sf_format == "fp32":
        scales = _typed_view(scales, torch.float32)
    return KVCacheViews(values, scales)


def _as_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 ``[num_blocks, block_size, 1, bytes_per_token]`` (BF16 caches are
    reinterpreted byte-wise)."""
    if kv_cache.dtype == torch.uint8:
        return kv_cache
    return kv_cache.view(torch.uint8)


def resolve_kv_cache_layout(
    kv_cache: torch.Tensor, layout: KVCacheFormat | None = None
) -> KVCacheFormat:
    """Return the cache's format, checking that ``kv_cache`` matches it.

    ``kv_cache``: uint8 ``[num_blocks, block_size, 1, bytes_per_token]`` (from
    :func:`alloc_kv_cache`), or bfloat16 ``[num_blocks, block_size, 1, n]`` for a plain BF16
    cache. Without ``layout`` the format is inferred: a bfloat16 cache is ``bf16_format(n)``; a
    uint8 cache is the supported format with that ``bytes_per_token``. Unknown widths and
    ambiguous ones (132 bytes is both FP8_FLOAT32_SF_INDEX and MXFP8_INDEX) raise ``ValueError``
    asking for ``layout=``.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype not in (torch.uint8, torch.bfloat16):
        raise TypeError(f"kv_cache must have dtype uint8 or bfloat16, got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(
            "kv_cache must have shape [num_blocks, block_size, 1, width], "
            f"got {tuple(kv_cache.shape)}"
        )
    if layout is None:
        layout = _infer_layout(kv_cache)
    elif not isinstance(layout, KVCacheFormat):
        raise TypeError(f"layout must be a KVCacheFormat or None, got {type(layout).__name__}")
    if kv_cache.dtype == torch.bfloat16 and layout.is_quantized:
        raise ValueError(f"kv_cache is bfloat16 but layout is quantized ({layout.note!r})")
    raw = _as_bytes(kv_cache)
    bpt = layout.bytes_per_token
    if raw.shape[3] != bpt:
        raise ValueError(
            f"kv_cache has {raw.shape[3]} bytes per token but layout {layout.note!r} needs {bpt}"
        )
    num_blocks, block_size = raw.shape[0], raw.shape[1]
    if raw.stride(3) != 1 or (block_size > 1 and raw.stride(1) != bpt):
        raise ValueError(
            f"kv_cache must store tokens contiguously (strides (*, {bpt}, *, 1)), "
            f"got strides {raw.stride()}"
        )
    if num_blocks > 1 and raw.stride(0) < block_size * bpt:
        raise ValueError(
            f"kv_cache block stride {raw.stride(0)} is smaller than block_size * "
            f"bytes_per_token = {block_size * bpt}"
        )
    return layout


def _infer_layout(kv_cache: torch.Tensor) -> KVCacheFormat:
    width = kv_cache.shape[3]
    if kv_cache.dtype == torch.bfloat16:
        return bf16_format(width)
    matches = [f for f in SUPPORTED_KV_CACHE_FORMATS if f.bytes_per_token == width]
    if not matches:
        known = sorted({f.bytes_per_token for f in SUPPORTED_KV_CACHE_FORMATS})
        raise ValueError(
            f"kv_cache: unknown layout for a uint8 cache of {width} bytes per token "
            f"(supported widths {known}); pass layout=, e.g. bf16_format(n)"
        )
    if len(matches) > 1:
        names = ", ".join(repr(f.note) for f in matches)
        raise ValueError(
            f"kv_cache: {width} bytes per token is ambiguous between {names}; pass layout="
        )
    return matches[0]
