"""Cache formats shared by the store and load tests."""

from kvplan.formats import SUPPORTED_KV_CACHE_FORMATS, KVCacheFormat, bf16_format

# what the engine uses besides the five named formats: FP8 over all heads, and plain BF16
ENGINE_FP8 = KVCacheFormat(
    "e4m3", 2 * 64, 32, 0, True, "fp32", "engine fp8 2x64", True, scale_search=True
)
FP8_FP32_PLAIN = KVCacheFormat("e4m3", 2 * 64, 32, 0, True, "fp32", "fp8 2x64 amax/448", True)
ENGINE_FP8_UE8M0 = KVCacheFormat("e4m3", 2 * 64, 32, 0, True, "ue8m0", "fp8 2x64 ue8m0", True)
ODD_FORMATS = [
    KVCacheFormat("e4m3", 40, 24, 0, True, "ue8m0", "partial last group", True),
    KVCacheFormat("e2m1", 36, 10, 0, False, "fp32", "fp4 fp32 scales"),
    KVCacheFormat("e2m1", 24, 6, 0, True, "e4m3", "fp4 e4m3 odd groups", True),
    KVCacheFormat("e4m3", 20, 4, 0, False, "ue8m0", "index, 5 ue8m0 scales"),
    KVCacheFormat("e4m3", 48, 16, 0, False, "e4m3", "fp8 with e4m3 scales"),
    # a power-of-two row shorter than its scale group (index layouts at small widths)
    KVCacheFormat("e4m3", 16, 32, 0, False, "ue8m0", "index row shorter than its group"),
    KVCacheFormat("e2m1", 16, 32, 0, False, "ue8m0", "fp4 index row shorter than its group"),
    bf16_format(3),
]


def all_formats(odd_formats: list[KVCacheFormat]) -> list[KVCacheFormat]:
    """The named formats, the engine's, and ``odd_formats``."""
    return [
        *SUPPORTED_KV_CACHE_FORMATS,
        ENGINE_FP8,
        FP8_FP32_PLAIN,
        ENGINE_FP8_UE8M0,
        bf16_format(24),
        *odd_formats,
    ]


def ids(f: KVCacheFormat) -> str:
    return f.note
