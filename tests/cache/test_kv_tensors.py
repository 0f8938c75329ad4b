"""KVCacheTensors: shapes, dtypes, store by slot (with -1 skips) against a per-token loop."""

import unittest.mock

import pytest
import torch

from kvplan.cache import KVCacheTensors


def store_ref(cache, x, slots, block_size):
    """Per-token loop: the obviously-correct store."""
    out = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // block_size, s % block_size] = x[i].to(out.dtype)
    return out


@pytest.mark.parametrize("kv_format", ["bf16", "fp16", "fp32"])
def test_store_matches_loop(kv_format):
    g = torch.Generator().manual_seed(0)
    kv = KVCacheTensors(
        2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16, kv_format=kv_format
    )
    assert kv.k_cache(1).shape == (6, 4, 2, 16) and kv.k_cache(1).dtype == kv.dtype
    assert not kv.is_quantized
    slots = torch.tensor([4, 23, -1, 5, 12, -1, 7], dtype=torch.int32)
    k = torch.randn(7, 2, 16, generator=g)
    v = torch.randn(7, 2, 16, generator=g)
    want_k = store_ref(kv.k_cache(1), k, slots, 4)
    want_v = store_ref(kv.v_cache(1), v, slots, 4)
    kv.store(1, k, v, slots)
    assert torch.equal(kv.k_cache(1), want_k) and torch.equal(kv.v_cache(1), want_v)
    assert not kv.k_cache(0).any()  # other layers untouched
    assert not kv.k_cache(1)[0].any()  # padding block untouched
    kb, vb = kv.read_blocks(1, torch.tensor([1, 5]))
    assert torch.equal(kb, want_k[[1, 5]]) and torch.equal(vb, want_v[[1, 5]])


def test_bf16_is_a_view_of_the_alloc_kv_cache_buffer():
    kv = KVCacheTensors(1, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=8)
    raw = kv.raw_k_cache(0)
    assert raw.dtype == torch.uint8 and raw.shape == (3, 2, 1, 16)
    assert kv.layout.bf16_elements == 8
    kv.k_cache(0)[2, 1, 0, 3] = 1.5
    assert raw.view(torch.bfloat16)[2, 1, 0, 3].item() == 1.5


def test_bad_arguments():
    kv = KVCacheTensors(1, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=8, kv_format="fp32")
    k = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping holds 6"):
        kv.store(0, k, k, torch.tensor([0, 6]))
    with pytest.raises(TypeError, match="slot_mapping"):
        kv.store(0, k, k, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="k must have shape"):
        kv.store(0, torch.zeros(2, 2, 8), k, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="layer"):
        kv.k_cache(1)
    with pytest.raises(ValueError, match="kv_format"):
        KVCacheTensors(1, 3, 2, 1, 8, kv_format="int4")
    with pytest.raises(ValueError, match="head_dim % 32"):
        KVCacheTensors(1, 3, 2, 1, 48, kv_format="fp8")
    with pytest.raises(ValueError, match="head_dim % 32"):
        KVCacheTensors(1, 3, 2, 1, 48, kv_format="int8")


def test_fp8_layout():
    kv = KVCacheTensors(1, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=64, kv_format="fp8")
    assert kv.is_quantized and kv.dtype == torch.bfloat16
    assert (
        kv.layout.quantized_elements == 128 and kv.layout.bytes_per_token == 128 + 4 * 4
    )  # fp32 scale per 32
    assert kv.k_cache(0).dtype == torch.uint8 and kv.k_cache(0).shape == (3, 4, 1, 144)
    k, _ = kv.read_blocks(0, torch.tensor([0, 2]))
    assert k.shape == (2, 4, 2, 64) and not k.any()


def test_int8_layout_has_the_fp8_record_size():
    from kvplan.cache.kv_tensors import kv_bytes_per_value

    kv = KVCacheTensors(1, 3, 4, num_kv_heads=2, head_dim=64, kv_format="int8")
    assert kv.is_quantized and kv.dtype == torch.bfloat16 and kv.layout.quantized_dtype == "int8"
    assert kv.k_cache(0).shape == (3, 4, 1, 144) and kv.layout.sf_format == "fp32"
    assert kv_bytes_per_value("int8") == kv_bytes_per_value("fp8") == 1.125


@pytest.mark.parametrize("kv_format", ["fp8", "int8"])
def test_quantized_store_and_read_match_the_quantization_reference(kv_format):
    from kvplan import quant

    g = torch.Generator().manual_seed(1)
    kv = KVCacheTensors(2, 4, 4, num_kv_heads=2, head_dim=32, kv_format=kv_format)
    # heads with very different magnitudes: per-head groups keep each head's own scale
    k = torch.randn(5, 2, 32, generator=g) * torch.tensor([1e-3, 50.0])[None, :, None]
    v = torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([5, 6, -1, 15, 4], dtype=torch.int64)
    kv.store(1, k, v, slots)
    blocks = torch.tensor([1, 3])
    k_read, v_read = kv.read_blocks(1, blocks)  # [2, 4, 2, 32] bf16
    assert kv.layout.scale_search == (kv_format in ("fp8", "fp4"))
    for x, read in ((k, k_read), (v, v_read)):
        flat = x.to(torch.bfloat16).reshape(5, 64)
        want = quant.dequantize(*quant.quantize(flat, kv.layout), kv.layout).view(5, 2, 32)
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            b = [1, 3].index(s // 4)
            assert torch.equal(read[b, s % 4], want[i])
        rel = (read[0, 0] - x[4]).abs().max() / x[4].abs().max()
        assert rel < 0.1  # e4m3 keeps ~2 significant digits, int8 at least that
    assert not kv.k_cache(0).any() and not kv.k_cache(1)[0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp16", "fp8", "int8"])
def test_gpu_store_equals_cpu_store(kv_format):
    g = torch.Generator().manual_seed(2)
    caches = [
        KVCacheTensors(1, 8, 16, 4, 64, kv_format=kv_format, device=dev) for dev in ("cpu", "cuda")
    ]
    k = torch.randn(40, 4, 64, generator=g)
    v = torch.randn(40, 4, 64, generator=g)
    slots = torch.randperm(8 * 16, generator=g)[:40].to(torch.int32)
    slots[::7] = -1
    for kv in caches:
        kv.store(0, k.to(kv.device), v.to(kv.device), slots.to(kv.device))
    cpu, gpu = caches
    assert torch.equal(
        cpu.raw_k_cache(0).view(torch.uint8).flatten(),
        gpu.raw_k_cache(0).cpu().view(torch.uint8).flatten(),
    )
    assert torch.equal(
        cpu.raw_v_cache(0).view(torch.uint8).flatten(),
        gpu.raw_v_cache(0).cpu().view(torch.uint8).flatten(),
    )


def test_read_blocks_checks_ids():
    kv = KVCacheTensors(1, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="block_ids holds 3"):
        kv.read_blocks(0, torch.tensor([0, 3]))


def test_store_converts_the_slots_once_per_forward():
    """Layers of one step share one int32 conversion of the slot tensor; a new step (a layer
    not above the last one) converts again, so slots rewritten in between are never stale."""
    kv = KVCacheTensors(3, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=32,
                        kv_format="fp8")  # fmt: skip
    k = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([1, 6])
    seen = []
    real = torch.Tensor.to

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        if self is slots and out.dtype == torch.int32:
            seen.append(out)
        return out

    with unittest.mock.patch.object(torch.Tensor, "to", spy):
        for layer in range(3):
            kv.store(layer, k, k, slots)
        assert len(seen) == 1
        slots.data[0] = 9  # rewritten without a version bump (as a kernel would)
        kv.store(0, k, k, slots)  # a new step
        assert len(seen) == 2 and seen[1].tolist() == [9, 6]
    want = KVCacheTensors(3, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=32,
                          kv_format="fp8")  # fmt: skip
    for layer in range(3):
        want.store(layer, k, k, torch.tensor([1, 6], dtype=torch.int32))
    want.store(0, k, k, torch.tensor([9, 6], dtype=torch.int32))
    for layer in range(3):
        assert torch.equal(kv.raw_k_cache(layer), want.raw_k_cache(layer))


def test_fp8_scale_search_switch(monkeypatch):
    """fp8 searches its scales by default; KVPLAN_KV_SCALE_SEARCH=0 gives amax / 448 (the bytes
    of a plain fp32-scale layout); int8 never searches."""
    from kvplan import quant

    g = torch.Generator().manual_seed(6)
    k = torch.randn(4, 2, 64, generator=g) * torch.logspace(-1, 1, 64)
    slots = torch.arange(4)
    records = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("KVPLAN_KV_SCALE_SEARCH", switch)
        kv = KVCacheTensors(1, 2, 4, 2, 64, kv_format="fp8")
        assert kv.layout.scale_search == (switch == "1")
        kv.store(0, k, k, slots)
        records[switch] = (kv.raw_k_cache(0)[0].clone(), kv.raw_v_cache(0)[0].clone())
        want = quant.quantize(k.bfloat16().reshape(4, 128), kv.layout)
        assert torch.equal(records[switch][0][:, 0, :128], want[0])
    assert torch.equal(records["1"][0], records["1"][1])  # K and V written alike
    assert not torch.equal(records["1"][0], records["0"][0])  # searched vs plain scales
    monkeypatch.setenv("KVPLAN_KV_SCALE_SEARCH", "1")
    assert KVCacheTensors(1, 2, 4, 2, 64, kv_format="fp4").layout.scale_search
    assert not KVCacheTensors(1, 2, 4, 2, 64, kv_format="int8").layout.scale_search
