"""``kvplan.ops.read_slots``: a quantized engine cache's stored rows read back by slot in one
Triton launch per cache, against the format's own quantize-dequantize of the rows (and the
torch path of ``KVCacheTensors.read_slots``): bit-equal, padded blocks, int32 / int64 slots,
-1 slots, ``out=``, errors."""

from __future__ import annotations

import pytest
import torch

from kvplan.cache.kv_tensors import KVCacheTensors
from kvplan.ops.read_slots import read_slots_triton
from kvplan.quant import dequantize, quantize

FORMATS = ("fp8", "int8", "fp4")


def _filled(fmt, *, heads=2, head_dim=64, blocks=5, block_size=16, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    kv = KVCacheTensors(1, blocks, block_size, heads, head_dim, kv_format=fmt, device=device)
    n = blocks * block_size
    slots = torch.randperm(n, generator=gen)
    # rows of mixed scales: every group's amax differs, the small values round in the format
    k, v = (
        (
            torch.randn(n, heads, head_dim, generator=gen)
            * torch.rand(n, heads, 1, generator=gen)
            * 8
        )
        .bfloat16()
        .to(device)
        for _ in range(2)
    )
    kv.store(0, k, v, slots.to(device))
    return kv, k, v, slots


def _expected(x, layout):
    n = x.shape[0]
    return dequantize(*quantize(x.reshape(n, -1).cpu(), layout), layout).view(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_bit_equal_to_the_formats_dequantization(fmt, slot_dtype):
    kv, k, v, slots = _filled(fmt, seed=FORMATS.index(fmt))
    # 37 rows in a random order: a whole tile of 32 and a partial one
    pick = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(4))[:37]]
    order = torch.argsort(slots)  # row i was stored at slots[i]: position of each slot
    rows = order[pick]
    for cache, x in ((kv.raw_k_cache(0), k), (kv.raw_v_cache(0), v)):
        got = read_slots_triton(cache, pick.to(slot_dtype), kv.layout, 64)
        assert got.dtype == torch.bfloat16 and got.shape == (37, 2, 64)
        assert torch.equal(got, _expected(x[rows], kv.layout))
    # the torch path of KVCacheTensors.read_slots gives the same bits
    tk, tv = kv.read_slots(0, pick)
    assert torch.equal(tk, read_slots_triton(kv.raw_k_cache(0), pick, kv.layout, 64))
    assert torch.equal(tv, read_slots_triton(kv.raw_v_cache(0), pick, kv.layout, 64))


def test_minus_one_reads_zeros_and_out_is_filled_in_place():
    kv, k, _, slots = _filled("fp8", heads=1, head_dim=32, blocks=2, block_size=8, seed=3)
    pick = torch.tensor([int(slots[4]), -1, int(slots[9]), -1])  # rows 4 and 9 as stored
    out = torch.full((4, 1, 32), 7.0, dtype=torch.bfloat16)
    res = read_slots_triton(kv.raw_k_cache(0), pick, kv.layout, 32, out=out)
    assert res is out
    assert torch.equal(out[[0, 2]], _expected(k[[4, 9]], kv.layout)) and not out[[1, 3]].any()
    tk, _ = kv.read_slots(0, pick)  # the torch path agrees, -1 rows included
    assert torch.equal(tk, out)


def test_padded_block_stride():
    # 3 heads x 32 fp4 values: 48 value + 6 scale bytes = 54-byte records, whose blocks the
    # allocator pads to a multiple of 32 bytes: the kernel must use the real block stride
    kv, k, v, slots = _filled("fp4", heads=3, head_dim=32, blocks=3, block_size=4, seed=5)
    cache = kv.raw_k_cache(0)
    assert cache.stride(0) != cache.shape[1] * cache.shape[3]
    pick = slots.flip(0)
    order = torch.argsort(slots)
    got = read_slots_triton(cache, pick, kv.layout, 32)
    assert torch.equal(got, _expected(k[order[pick]], kv.layout))


def test_empty_and_bad_inputs():
    kv, *_ = _filled("fp8", heads=1, head_dim=32, blocks=1, block_size=4)
    cache = kv.raw_k_cache(0)
    assert read_slots_triton(cache, torch.zeros(0, dtype=torch.int64), kv.layout, 32).shape == (
        0, 1, 32,
    )  # fmt: skip
    with pytest.raises(TypeError, match="slots must have dtype"):
        read_slots_triton(cache, torch.zeros(2), kv.layout, 32)
    with pytest.raises(TypeError, match="cache must have dtype"):
        read_slots_triton(cache.float(), torch.zeros(2, dtype=torch.int64), kv.layout, 32)
    with pytest.raises(ValueError, match="head_dim 48"):
        read_slots_triton(cache, torch.zeros(2, dtype=torch.int64), kv.layout, 48)
    with pytest.raises(ValueError, match="out must have shape"):
        read_slots_triton(cache, torch.zeros(2, dtype=torch.int64), kv.layout, 32,
                          out=torch.empty(3, 1, 32, dtype=torch.bfloat16))  # fmt: skip
    bf16 = KVCacheTensors(1, 1, 4, 1, 32, kv_format="bf16")
    with pytest.raises(ValueError, match="token-interleaved quantized"):
        read_slots_triton(cache, torch.zeros(2, dtype=torch.int64), bf16.layout, 32)


def test_kv_tensors_takes_the_kernel_when_triton_is_forced(monkeypatch):
    import kvplan.ops.read_slots as rs

    kv, k, v, slots = _filled("int8", heads=2, head_dim=32, blocks=2, block_size=8, seed=9)
    calls = []
    real = rs.read_slots_triton
    monkeypatch.setattr(rs, "read_slots_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    want = kv.read_slots(0, slots[:5])
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    got = kv.read_slots(0, slots[:5])
    assert len(calls) == 2  # K and V
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_bit_equal(fmt):
    kv, k, v, slots = _filled(fmt, heads=8, head_dim=128, blocks=40, block_size=16, device="cuda")
    pick = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(1))[:500]]
    order = torch.argsort(slots)
    gk, gv = kv.read_slots(0, pick.cuda())
    assert torch.equal(gk.cpu(), _expected(k[order[pick].cuda()], kv.layout))
    assert torch.equal(gv.cpu(), _expected(v[order[pick].cuda()], kv.layout))
