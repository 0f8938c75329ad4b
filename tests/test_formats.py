"""KVCacheFormat validation, byte accounting, allocation, views and format inference."""

import math

import pytest
import torch

from kvplan.formats import (
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
    SUPPORTED_KV_CACHE_FORMATS,
    V41_FORMAT,
    V41_FP4_FORMAT,
    KVCacheFormat,
    alloc_kv_cache,
    bf16_format,
    resolve_kv_cache_layout,
    split_kv_cache,
)


def test_bytes_per_token_of_supported_formats():
    got = [f.bytes_per_token for f in SUPPORTED_KV_CACHE_FORMATS]
    assert got == [528, 288, 68, 132, 132]
    assert V41_FORMAT.num_scales == 16 and V41_FORMAT.sf_bytes == 16
    assert V41_FP4_FORMAT.quantized_bytes == 256 and V41_FP4_FORMAT.num_scales == 32
    assert FP4_INDEX_KV_FORMAT.quantized_bytes == 64 and FP4_INDEX_KV_FORMAT.sf_bytes == 4
    assert FP8_FLOAT32_SF_INDEX_KV_FORMAT.sf_bytes == 4
    assert MXFP8_INDEX_KV_FORMAT.num_scales == 4
    assert bf16_format(512).bytes_per_token == 1024
    assert V41_FORMAT.stride_alignment == 16 and V41_FP4_FORMAT.stride_alignment == 32
    assert FP4_INDEX_KV_FORMAT.stride_alignment == 32


def test_partial_last_group_counts_a_scale():
    f = KVCacheFormat("e4m3", 100, 32, 0, True, "ue8m0", "odd", True)
    assert f.num_scales == 4 and f.bytes_per_token == 104


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(quantized_dtype=None, quantized_elements=4, elements_per_sf=0), "quantized_elements"),
        (dict(quantized_dtype=None, quantized_elements=0, elements_per_sf=2), "elements_per_sf"),
        (dict(quantized_dtype=None, quantized_elements=0, elements_per_sf=0), "bf16_elements"),
        (dict(quantized_dtype="e4m3", quantized_elements=0, elements_per_sf=32), "quantized_el"),
        (dict(quantized_dtype="e4m3", quantized_elements=64, elements_per_sf=0), "elements_per_sf"),
        (dict(quantized_dtype="e5m2", quantized_elements=64, elements_per_sf=32), "quantized_dt"),
        (dict(quantized_dtype="e2m1", quantized_elements=63, elements_per_sf=32), "quantized_el"),
        (dict(quantized_dtype="e2m1", quantized_elements=64, elements_per_sf=15), "elements_per"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    base = dict(
        bf16_elements=0,
        do_cast=False,
        sf_format="ue8m0" if kwargs["quantized_dtype"] else None,
        note="bad",
    )
    with pytest.raises(ValueError, match=field):
        KVCacheFormat(**{**base, **kwargs})


def test_validation_rules_from_the_seed():
    with pytest.raises(ValueError, match="mixed"):
        KVCacheFormat("e4m3", 64, 32, 8, False, "ue8m0", "mixed")
    with pytest.raises(ValueError, match="token_interleaved"):
        KVCacheFormat("e4m3", 64, 32, 0, True, "ue8m0", "cast but split", False)
    with pytest.raises(ValueError, match="sf_format"):
        KVCacheFormat("e4m3", 64, 32, 0, False, None, "no scale")
    with pytest.raises(ValueError, match="sf_format"):
        KVCacheFormat(None, 0, 0, 8, False, "ue8m0", "scale without values")
    with pytest.raises(ValueError, match="num_elements"):
        bf16_format(0)
    for dtype, sf in (("e4m3", "ue8m0"), ("e4m3", "e4m3"), ("int8", "fp32"), ("e2m1", "fp32")):
        with pytest.raises(ValueError, match="scale_search"):
            KVCacheFormat(dtype, 64, 32, 0, True, sf, "searched", True, scale_search=True)
    with pytest.raises(ValueError, match="scale_search"):
        KVCacheFormat("e4m3", 64, 32, 0, True, "fp32", "searched", True, scale_search=1)
    with pytest.raises(ValueError, match="scale_search"):  # int32 error sums: <= 64 a group
        KVCacheFormat("e4m3", 256, 128, 0, True, "fp32", "searched", True, scale_search=True)


@pytest.mark.parametrize("layout", [*SUPPORTED_KV_CACHE_FORMATS, bf16_format(24)])
@pytest.mark.parametrize("block_size", [1, 64, 133])
def test_alloc_block_stride_rule(layout, block_size):
    cache = alloc_kv_cache(3, block_size, layout)
    bpt = layout.bytes_per_token
    assert cache.dtype == torch.uint8
    assert cache.shape == (3, block_size, 1, bpt)
    align = math.lcm(32, bpt) if layout.token_interleaved else 32
    stride = cache.stride(0)
    assert stride % align == 0 and stride >= block_size * bpt > stride - align
    assert cache.stride()[1:] == (bpt, bpt, 1)
    assert resolve_kv_cache_layout(cache, layout) is layout


def test_alloc_v41_block_133():
    assert alloc_kv_cache(2, 133, V41_FORMAT).stride(0) == 67 * 1056


def test_alloc_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        alloc_kv_cache(2, 0, V41_FORMAT)
    with pytest.raises(TypeError, match="layout"):
        alloc_kv_cache(2, 4, "v41")
    with pytest.raises(ValueError, match="overflows int32"):
        alloc_kv_cache(2**20, 2**12, bf16_format(1), device="meta")


def _fill_bytes(cache):
    """Write each byte's (block, byte) position into the backing storage."""
    storage = torch.as_strided(cache, (cache.shape[0], cache.stride(0)), (cache.stride(0), 1))
    g = torch.Generator().manual_seed(0)
    storage.copy_(torch.randint(0, 256, storage.shape, generator=g, dtype=torch.uint8))
    return storage


@pytest.mark.parametrize("layout", SUPPORTED_KV_CACHE_FORMATS)
def test_split_views_address_the_documented_bytes(layout):
    block_size = 5
    cache = alloc_kv_cache(3, block_size, layout)
    storage = _fill_bytes(cache)
    values, scales = split_kv_cache(cache, layout)
    vb, sb = layout.quantized_bytes, layout.sf_bytes
    for b in range(3):
        for t in range(block_size):
            if layout.token_interleaved:
                v0 = t * layout.bytes_per_token
                s0 = v0 + vb
            else:
                v0 = t * vb
                s0 = block_size * vb + t * sb
            assert torch.equal(values[b, t].view(torch.uint8), storage[b, v0 : v0 + vb])
            assert torch.equal(
                scales[b, t].contiguous().view(torch.uint8), storage[b, s0 : s0 + sb]
            )
    assert scales.shape[-1] == layout.num_scales
    expected_dtype = {
        "ue8m0": torch.uint8,
        "e4m3": torch.float8_e4m3fn,
        "fp32": torch.float32,
    }[layout.sf_format]
    assert scales.dtype == expected_dtype


def test_split_fp4_reports_logical_element_strides():
    cache = alloc_kv_cache(2, 4, V41_FP4_FORMAT)
    views = split_kv_cache(cache)
    assert views.values.dtype == torch.float4_e2m1fn_x2
    assert views.values.shape == (2, 4, 256)
    assert views.value_element_strides == (2 * cache.stride(0), 2 * 288, 2)
    index = split_kv_cache(alloc_kv_cache(2, 4, FP4_INDEX_KV_FORMAT))
    assert index.value_element_strides[1] == 128
    fp8 = split_kv_cache(alloc_kv_cache(2, 4, V41_FORMAT))
    assert fp8.value_element_strides == fp8.values.stride()


def test_split_bf16_has_no_scales():
    layout = bf16_format(8)
    cache = alloc_kv_cache(2, 4, layout)
    values, scales = split_kv_cache(cache, layout)
    assert scales is None and values.dtype == torch.bfloat16 and values.shape == (2, 4, 8)


def test_resolve_infers_unambiguous_formats():
    for layout in (V41_FORMAT, V41_FP4_FORMAT, FP4_INDEX_KV_FORMAT):
        assert resolve_kv_cache_layout(alloc_kv_cache(2, 4, layout)) is layout
    plain = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    assert resolve_kv_cache_layout(plain) == bf16_format(16)


def test_resolve_errors():
    with pytest.raises(ValueError, match="ambiguous"):
        resolve_kv_cache_layout(alloc_kv_cache(2, 4, MXFP8_INDEX_KV_FORMAT))
    with pytest.raises(ValueError, match="unknown layout"):
        resolve_kv_cache_layout(torch.zeros(2, 4, 1, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes per token"):
        resolve_kv_cache_layout(alloc_kv_cache(2, 4, V41_FORMAT), V41_FP4_FORMAT)
    with pytest.raises(TypeError, match="dtype"):
        resolve_kv_cache_layout(torch.zeros(2, 4, 1, 528, dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        resolve_kv_cache_layout(torch.zeros(2, 4, 528, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_kv_cache_layout(torch.zeros(2, 4, 1, 264, dtype=torch.bfloat16), V41_FORMAT)
    strided = torch.zeros(2, 4, 1, 1056, dtype=torch.uint8)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        resolve_kv_cache_layout(strided, V41_FORMAT)
