"""Paged attention reading fp8 / int8 / fp4 pages in place == dequantize first, then dense attention.

Each case takes ``make_case``'s float cache (random keys where some query looks, NaN
elsewhere), quantizes every written slot into the records of a token-interleaved cache
(``kvplan.quant.quantize``) and fills every other slot with 0xFF bytes (NaN e4m3 codes, NaN
fp32 / e4m3 scales; int8 codes -1 under a NaN scale), so a kernel that reads an unused slot
poisons its output. The reference decodes the records with torch's own float8 / int8 types
and a table of the e2m1 values, in fp32, and
runs the per-query float64 ``paged_attention_ref`` over them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import kvplan.ops._paged_attention_kernels as pak
from kvplan import quant
from kvplan.formats import KVCacheFormat, alloc_kv_cache
from kvplan.ops._paged_kv_tiles import (
    E2M1_F16,
    E2M1_F16_NIB,
    kv_geometry,
    load_kv_tile,
)
from kvplan.ops.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_torch,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_torch,
    paged_attention_prefill_triton,
    paged_attention_ref,
)
from tests.ops.test_paged_attention import Case, assert_close, make_case

# (quantized dtype, values per scale, scale format): the engine's fp8, int8 and fp4, plus UE8M0
FORMATS = {
    "fp8": ("e4m3", 32, "fp32"),
    "int8": ("int8", 32, "fp32"),
    "fp4": ("e2m1", 16, "e4m3"),
    "fp8_ue8m0": ("e4m3", 32, "ue8m0"),
    "fp8_g8": ("e4m3", 8, "fp32"),  # mode 2's grouped V dot then has 8 columns
    "fp8_g16": ("e4m3", 16, "fp32"),  # 2 groups at head_dim 32
}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def layout_of(kind: str, num_kv_heads: int, head_dim: int) -> KVCacheFormat:
    dtype, group, sf = FORMATS[kind]
    hd = num_kv_heads * head_dim
    return KVCacheFormat(dtype, hd, group, 0, True, sf, f"test {kind} x{hd}", True)


def quantize_cache(cache: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """float ``[N, bs, H, D]`` (NaN = unused slot) -> uint8 ``[N, bs, 1, bytes_per_token]``."""
    n, bs = cache.shape[:2]
    raw = alloc_kv_cache(n, bs, layout)
    torch.as_strided(raw, (raw.untyped_storage().nbytes(),), (1,), 0).fill_(0xFF)
    flat = cache.reshape(n * bs, -1)  # [N*bs, H*D]
    used = ~flat.isnan().any(-1)
    values, scales = quant.quantize(flat[used].to(torch.bfloat16), layout)
    slots = torch.nonzero(used).flatten()
    raw[slots // bs, slots % bs, 0] = torch.cat([values, scales], dim=1)  # in place (a view)
    return raw


def dequantize_cache(raw: torch.Tensor, layout: KVCacheFormat, head_dim: int) -> torch.Tensor:
    """Independent fp32 decode of every record: ``[N, bs, Hkv, D]``."""
    n, bs = raw.shape[:2]
    rec = raw[:, :, 0].reshape(n * bs, -1)  # (a copy when blocks are padded)
    nv = layout.quantized_bytes
    vbytes, sbytes = rec[:, :nv], rec[:, nv : nv + layout.sf_bytes]
    if layout.quantized_dtype == "e2m1":
        codes = torch.stack((vbytes & 15, vbytes >> 4), dim=-1).reshape(n * bs, -1).long()
        vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    elif layout.quantized_dtype == "int8":
        vals = vbytes.contiguous().view(torch.int8).float()
    else:
        vals = vbytes.contiguous().view(torch.float8_e4m3fn).float()
    if layout.sf_format == "fp32":
        sf = sbytes.contiguous().view(torch.float32)
    elif layout.sf_format == "e4m3":
        sf = sbytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        sf = torch.exp2(sbytes.float() - 127)
    out = vals * sf.repeat_interleave(layout.elements_per_sf, dim=1)
    return out.view(n, bs, -1, head_dim)


def quantized_case(kind: str, seed: int, kv_lens, q_lens, **kw):
    """(``make_case`` case, its quantized caches, layout, fp32 dequantized case)."""
    c = make_case(seed, kv_lens, q_lens, **kw)
    hkv, d = c.k_cache.shape[2], c.k_cache.shape[3]
    layout = layout_of(kind, hkv, d)
    k_raw, v_raw = quantize_cache(c.k_cache, layout), quantize_cache(c.v_cache, layout)
    dq = Case(
        c.q, dequantize_cache(k_raw, layout, d), dequantize_cache(v_raw, layout, d),
        c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens, c.scale, c.window,
    )  # fmt: skip
    return c, (k_raw, v_raw), layout, dq


# --- Triton under the interpreter (fp32 q, so the dequantized values stay exact) -------------

DECODE = [
    # (kind, seed, kv_lens, group, block_size, window, layout, num_splits, tile_n)
    ("fp8", 0, [1, 7, 13], 1, 4, None, "ragged", 1, 16),
    ("fp8", 1, [5, 33, 18], 4, 8, 11, "offsets", 3, 16),  # (head_dim 64: two scales a head)
    ("fp4", 2, [40, 9, 0], 2, 4, None, "ragged", 2, 16),
    ("fp4", 3, [70, 35], 4, 32, None, "offsets", 2, 16),  # whole tiles inside one page
    ("fp8_ue8m0", 4, [29, 3], 2, 16, 5, "ragged", 1, 16),
    ("int8", 0, [1, 7, 13], 1, 4, None, "ragged", 1, 16),
    ("int8", 1, [5, 33, 18], 4, 8, 11, "offsets", 3, 16),  # (head_dim 64: two scales a head)
]


@pytest.mark.parametrize("kind,seed,kv_lens,group,block_size,window,layout,splits,tile_n", DECODE)
@pytest.mark.parametrize("heads", [1, 2])
def test_decode_triton_reads_quantized_pages(
    kind, seed, kv_lens, group, block_size, window, layout, splits, tile_n, heads
):
    """Also with two KV heads a program (their value and scale runs read as one head's)."""
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, seed, kv_lens, [1] * len(kv_lens), group=group, block_size=block_size,
        window=window, layout=layout, head_dim=64 if seed == 1 else 32,
    )  # fmt: skip
    got = paged_attention_decode_triton(
        c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens, scale=c.scale,
        sliding_window=window, num_splits=splits, tile_n=tile_n, kv_layout=fmt, heads=heads,
    )  # fmt: skip
    assert_close(got, dq.ref(decode=True))
    if 0 in kv_lens:
        assert not got[kv_lens.index(0)].any()


PREFILL = [
    # (kind, seed, kv_lens, q_lens, group, block_size, window)
    ("fp8", 10, [9, 14, 3], [9, 4, 1], 1, 4, None),
    ("fp8", 11, [40, 17], [16, 3], 2, 8, 6),  # partial last pages, window
    ("fp4", 12, [21, 6, 11], [3, 6, 1], 4, 8, None),
    ("fp4", 13, [45, 20], [40, 20], 1, 16, 20),
    ("int8", 10, [9, 14, 3], [9, 4, 1], 1, 4, None),
    ("int8", 11, [40, 17], [16, 3], 2, 8, 6),
]


@pytest.mark.parametrize("kind,seed,kv_lens,q_lens,group,block_size,window", PREFILL)
def test_prefill_triton_reads_quantized_pages(kind, seed, kv_lens, q_lens, group, block_size,
                                              window):  # fmt: skip
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, seed, kv_lens, q_lens, group=group, block_size=block_size, window=window,
        layout="offsets" if seed % 2 else "ragged", head_dim=32,
    )  # fmt: skip
    got = paged_attention_prefill_triton(
        c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens, scale=c.scale,
        sliding_window=window, max_q_len=max(q_lens), tile_m=16, tile_n=16, kv_layout=fmt,
    )  # fmt: skip
    assert_close(got, dq.ref(decode=False))


@pytest.mark.parametrize("kind", ["fp8", "fp4", "int8", "fp8_g8"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("mode", [1, 2])
def test_prefetched_tiles_give_the_same_result(kind, decode, mode, monkeypatch):
    """``prefetch=1``: the whole tiles' bytes loaded one step ahead (the tile after the last
    loads nothing) -- the reference again, and the same values as without it. ``prefetch=2``:
    the page-table lookups one step ahead and V's scales on the probabilities -- the
    reference again, within fp32 rounding of the plain loop."""
    calls = []
    real = pak._ahead_step  # one call per whole tile the loop attends
    monkeypatch.setattr(pak, "_ahead_step", lambda *a: calls.append(a[-2]) or real(*a))
    kv_lens, q_lens = [70, 35, 129, 1], ([1] * 4 if decode else [9, 35, 3, 1])
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, 21, kv_lens, q_lens, group=2, block_size=16, layout="offsets", head_dim=32
    )
    for prefetch in (mode, 0):
        if decode:
            got = paged_attention_decode_triton(
                c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens, scale=c.scale,
                num_splits=2, tile_n=16, kv_layout=fmt, prefetch=prefetch,
            )  # fmt: skip
        else:
            got = paged_attention_prefill_triton(
                c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens,
                scale=c.scale, max_q_len=max(q_lens), tile_m=16, tile_n=16, kv_layout=fmt,
                prefetch=prefetch,
            )  # fmt: skip
        assert_close(got, dq.ref(decode=decode))
        if prefetch:
            first = got
            assert calls and set(calls) == {mode}  # MODE (V_GROUPS follows)
    if mode == 1:
        assert torch.equal(first, got)
    else:
        assert_close(first, got, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_bf16_query_over_quantized_pages(kind, decode):
    """A bf16 q, as the GPU engine runs it, under the interpreter (bf16 dots widened to fp32
    by kvplan.ops._interpreter_bf16): the tiles are dequantized into bf16, so the reference is
    the float64 attention over the bf16 rounding of the exact decode; within the output's
    bf16 rounding."""
    kv_lens = [3, 41, 70]
    q_lens = [1] * 3 if decode else [3, 9, 20]
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, 60, kv_lens, q_lens, group=4, block_size=16, layout="offsets", head_dim=64
    )
    q = c.q.bfloat16()
    if decode:
        got = paged_attention_decode_triton(q, k_raw, v_raw, c.page_ids, c.page_start,
                                            c.kv_lens, scale=c.scale, num_splits=2, tile_n=16,
                                            kv_layout=fmt)  # fmt: skip
    else:
        got = paged_attention_prefill_triton(
            q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens,
            scale=c.scale, max_q_len=max(q_lens), tile_m=16, tile_n=16, kv_layout=fmt,
        )  # fmt: skip
    bf = dataclasses.replace(dq, q=q.float(), k_cache=dq.k_cache.bfloat16().float(),
                             v_cache=dq.v_cache.bfloat16().float())  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert_close(got, bf.ref(decode=decode), atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_decode_heads_side_by_side(kind, mode):
    """Two and four KV heads a program (their value and scale runs read as one head's, a
    block-diagonal query), a bf16 query, each prefetch mode (fp4: the default fp16 tiles):
    the reference within bf16 rounding, as with one head a program."""
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, 62, [3, 41, 70], [1] * 3, num_kv_heads=4, group=4, block_size=16,
        layout="offsets", head_dim=64,
    )  # fmt: skip
    q = c.q.bfloat16()
    bf = dataclasses.replace(dq, q=q.float(), k_cache=dq.k_cache.bfloat16().float(),
                             v_cache=dq.v_cache.bfloat16().float())  # fmt: skip
    want = bf.ref(decode=True)
    for heads in (1, 2, 4):
        got = paged_attention_decode_triton(
            q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens, scale=c.scale, num_splits=2,
            tile_n=16, kv_layout=fmt, prefetch=mode, heads=heads,
        )  # fmt: skip
        assert got.isfinite().all()
        assert_close(got, want, atol=4e-3, rtol=8e-3)


def test_default_heads_follow_the_key_count(monkeypatch):
    """A launch that names no ``heads`` takes `DECODE_HEADS_AUTO`'s count (fp8: two KV heads a
    program; its bound and `DECODE_HEADS_MIN_PROGRAMS` lowered here for a small case) only when
    its host bound on the key count exceeds the bound and it has enough programs, with the same
    attention either way; other formats keep one; ``KVPLAN_DECODE_HEADS`` overrides the table
    and leaves no context bounds."""
    monkeypatch.setattr(pak, "DECODE_HEADS", None)
    monkeypatch.setattr(pak, "DECODE_HEADS_AUTO", {"e4m3": (2, 32)})
    monkeypatch.setattr(pak, "DECODE_HEADS_MIN_PROGRAMS", 6)  # 3 sequences x 2 KV-head pairs
    assert pak.decode_context_bounds("e4m3") == (32,)
    assert pak.decode_context_bounds("int8") == ()
    seen = []
    real = pak.launch_decode
    monkeypatch.setattr(
        pak, "launch_decode", lambda *a, **k: seen.append(k["heads"]) or real(*a, **k)
    )
    for kind, bounds, want_heads in (("fp8", (32, 33, 70), [1, 2, 2]), ("int8", (70,), [1])):
        c, (k_raw, v_raw), fmt, dq = quantized_case(
            kind, 62, [3, 41, 70], [1] * 3, num_kv_heads=4, group=4, block_size=16,
            layout="offsets", head_dim=64,
        )  # fmt: skip
        want = dq.ref(decode=True)
        seen.clear()
        for bound in bounds:
            got = paged_attention_decode_triton(
                c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens, scale=c.scale,
                max_kv_len=bound, num_splits=2, tile_n=16, kv_layout=fmt,
            )  # fmt: skip
            assert_close(got, want)
        assert seen == want_heads
    # fewer (sequence, pair) programs than the minimum: one head
    assert pak.auto_heads("e4m3", 70, 12) == 2 and pak.auto_heads("e4m3", 70, 11) == 1
    monkeypatch.setattr(pak, "DECODE_HEADS", 1)
    assert pak.auto_heads("e4m3", 8192) == 1
    assert pak.decode_context_bounds("e4m3") == ()


def test_quantized_head_dim_16_fp4():
    """fp4 with head_dim 16: one scale per head record."""
    c, (k_raw, v_raw), fmt, dq = quantized_case("fp4", 14, [11, 4], [3, 1], group=2,
                                                head_dim=16)  # fmt: skip
    got = paged_attention_prefill_triton(
        c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens, scale=c.scale,
        tile_m=16, tile_n=16, kv_layout=fmt,
    )  # fmt: skip
    assert_close(got, dq.ref(decode=False))


# --- torch path (CPU dispatch): bf16 dequantization, as kvplan.quant.dequantize -------------


@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4"])
@pytest.mark.parametrize("seed", range(3))
def test_torch_paths_read_quantized_pages(kind, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    batch = int(torch.randint(1, 4, (), generator=gen))
    kv_lens = torch.randint(1, 30, (batch,), generator=gen).tolist()
    q_lens = [int(torch.randint(1, n + 1, (), generator=gen)) for n in kv_lens]
    window = [None, 5, 9][seed]
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        kind, seed, kv_lens, q_lens, group=[1, 2, 4][seed], block_size=[1, 4, 16][seed],
        window=window, head_dim=32,
    )  # fmt: skip
    got = paged_attention_prefill_torch(
        c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens, scale=c.scale,
        sliding_window=window, kv_layout=fmt,
    )  # fmt: skip
    # the torch path rounds each dequantized value to bf16 (quant.dequantize) before fp32 math
    want = paged_attention_ref(
        c.q, dq.k_cache.bfloat16().float(), dq.v_cache.bfloat16().float(), c.page_ids, c.page_start,
        c.cu_seqlens_q, c.kv_lens, scale=c.scale, sliding_window=window,
    )  # fmt: skip
    assert_close(got, want)
    assert_close(got, dq.ref(decode=False), atol=3e-2)  # bf16 rounding of K/V only
    last = c.cu_seqlens_q[1:] - 1  # decode over the same pages: each sequence's last query
    got = paged_attention_decode(
        c.q[last.long()], k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens, scale=c.scale,
        sliding_window=window, kv_layout=fmt,
    )  # fmt: skip
    assert_close(got, want[last.long()])


def test_dispatch_decode_torch_equals_triton_interpreter_on_bf16_values():
    """Same bf16-rounded K/V on both paths: torch (CPU dispatch) vs Triton (interpreter)."""
    c, (k_raw, v_raw), fmt, _ = quantized_case("fp8", 40, [12, 30], [1, 1], group=4,
                                               head_dim=32)  # fmt: skip
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens)
    torch_out = paged_attention_decode_torch(*args, scale=c.scale, kv_layout=fmt)
    triton_out = paged_attention_decode_triton(*args, scale=c.scale, kv_layout=fmt, tile_n=16)
    assert_close(triton_out, torch_out, atol=3e-2)


# --- caller errors -----------------------------------------------------------------------------


def test_quantized_layout_errors():
    c, (k_raw, v_raw), fmt, _ = quantized_case("fp8", 50, [6, 9], [1, 1], head_dim=32)
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens)
    with pytest.raises(TypeError, match="k_cache"):
        paged_attention_decode(c.q, c.k_cache, c.v_cache, *args[3:], scale=1.0, kv_layout=fmt)
    with pytest.raises(TypeError, match="kv_layout"):
        paged_attention_decode(*args, scale=1.0, kv_layout="fp8")
    with pytest.raises(ValueError, match="k_cache must have shape"):
        wrong = layout_of("fp4", 2, 32)
        paged_attention_decode(*args, scale=1.0, kv_layout=wrong)
    with pytest.raises(ValueError, match="whole heads"):
        paged_attention_decode(c.q[..., :16].contiguous(), *args[1:], scale=1.0, kv_layout=fmt)
    index = KVCacheFormat("e4m3", 64, 32, 0, False, "fp32", "not cast")
    with pytest.raises(ValueError, match="cast-on-load"):
        paged_attention_decode(*args, scale=1.0, kv_layout=index)


# --- GPU ---------------------------------------------------------------------------------------


@triton.jit
def _tile_copy_kernel(cache, sf, out, q, n, REC: tl.constexpr, TILE_N: tl.constexpr,
                      D: tl.constexpr, KVQ: tl.constexpr, SFK: tl.constexpr,
                      G: tl.constexpr):  # fmt: skip
    """``out[i] = load_kv_tile`` of token record ``i`` (head 0), in q's dtype."""
    i = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    qq = tl.load(q + tl.arange(0, D))
    t = load_kv_tile(cache, sf, i.to(tl.int64) * REC, i < n, qq, TILE_N, D, True, KVQ, SFK, G)
    tl.store(out + i[:, None] * D + tl.arange(0, D)[None, :], t, mask=(i < n)[:, None])


def nibble_order(head_dim: int) -> list[int]:
    """The head dimension held by each column of an ``E2M1_F16_NIB`` tile: within each group
    of 8 (one int32 word of nibbles), column ``2i + h`` holds dimension ``i + 4h``."""
    return [d - d % 8 + (d % 8 >> 1) + 4 * (d & 1) for d in range(head_dim)]


def _tile_copy(kind, kv_lens, device, head_dim, kv_quant=None):
    """``(tiles, exact decode, written)``: `_tile_copy_kernel` over every token record of a
    ``kind`` K cache (head 0, bf16 query; ``kv_quant`` overrides the geometry's)."""
    c, (k_raw, _), fmt, dq = quantized_case(kind, 7, kv_lens, [1] * len(kv_lens),
                                            num_kv_heads=4, group=4, head_dim=head_dim,
                                            block_size=16)  # fmt: skip
    geo = kv_geometry(k_raw, k_raw, head_dim, fmt)
    n = k_raw.shape[0] * k_raw.shape[1]
    flat = k_raw.to(device).reshape(-1)
    out = torch.empty(n, head_dim, dtype=torch.bfloat16, device=device)
    q = torch.zeros(head_dim, dtype=torch.bfloat16, device=device)
    _tile_copy_kernel[(triton.cdiv(n, 64),)](
        flat, flat[geo.sf_off :], out, q, n, k_raw.stride(1), 64, head_dim,
        geo.kv_quant if kv_quant is None else kv_quant, geo.sf_kind, geo.group,
    )  # fmt: skip
    want = dq.k_cache[:, :, 0].reshape(n, head_dim)
    written = want.isfinite().all(-1)  # unused slots decode to NaN
    assert written.sum() == sum(kv_lens)
    out = out.cpu()
    if kv_quant == E2M1_F16_NIB:  # columns in nibble order, values times 2^-14: the values
        tiny, out = out, torch.empty_like(out)
        out[:, nibble_order(head_dim)] = (tiny.float() * 16384.0).to(out.dtype)
    return out, want, written


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4", "fp4_f16", "fp4_nib"])
def test_gpu_in_register_dequantization_is_bit_exact(kind):
    """The kernels' in-register dequantization (``load_kv_tile``) gives bit for bit the bf16
    rounding of the independent fp32 decode, for every written token record (fp4_f16: the
    fp16 tiles of ``E2M1_F16``, the exact values; fp4_nib: ``E2M1_F16_NIB``'s, the values
    times 2^-14 in nibble order, fp16 subnormals among them)."""
    kv_quant = {"fp4_f16": E2M1_F16, "fp4_nib": E2M1_F16_NIB}.get(kind)
    out, want, written = _tile_copy(kind[:3] if kv_quant else kind, [300, 17, 1], "cuda", 128,
                                    kv_quant)  # fmt: skip
    assert torch.equal(out[written], want.bfloat16()[written])


@pytest.mark.parametrize("kv_quant", [E2M1_F16, E2M1_F16_NIB])
def test_fp4_f16_tiles_are_the_exact_values(kv_quant):
    """``E2M1_F16`` tiles (int32 words of nibbles unpacked in pairs, fp16 scales; interpreter)
    hold every written record's exact decode: the same bits as the bf16 tiles.
    ``E2M1_F16_NIB`` tiles hold them times 2^-14, column ``p`` dimension ``nibble_order[p]``."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test above")
    out, want, written = _tile_copy("fp4", [70, 17, 1], "cpu", 64, kv_quant)
    assert torch.equal(out[written].float(), want[written])
    bf16_tiles = _tile_copy("fp4", [70, 17, 1], "cpu", 64)[0]
    assert torch.equal(out[written], bf16_tiles[written])


@pytest.mark.parametrize("nib", [False, True])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_fp4_f16_decode_equals_the_reference(mode, nib, monkeypatch):
    """Decode over fp4 pages with ``FP4_F16_TILES`` (interpreter): the launch takes
    ``E2M1_F16`` (``E2M1_F16_NIB`` with ``FP4_NIBBLE_TILES``) and each prefetch mode gives
    the attention of the bf16 query over the exact values, as the bf16 tiles do; a query of
    2^20-sized values (shifted into fp16's range) too. Bad alignment or other scales keep the
    geometry's kind."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    kinds = []
    real = pak._kv_quant
    monkeypatch.setattr(pak, "_kv_quant", lambda *a: kinds.append(real(*a)) or kinds[-1])
    monkeypatch.setattr(pak, "FP4_NIBBLE_TILES", nib)
    f16_kind = E2M1_F16_NIB if nib else E2M1_F16
    c, (k_raw, v_raw), fmt, dq = quantized_case(
        "fp4", 61, [3, 41, 70], [1] * 3, group=4, block_size=16, layout="offsets", head_dim=64
    )
    for big in (1.0, 2.0**20):
        q = (c.q * big).bfloat16()
        kw = dict(scale=c.scale, num_splits=2, tile_n=16, kv_layout=fmt, prefetch=mode)
        args = (q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens)
        monkeypatch.setattr(pak, "FP4_F16_TILES", False)
        plain = paged_attention_decode_triton(*args, **kw)
        monkeypatch.setattr(pak, "FP4_F16_TILES", True)
        got = paged_attention_decode_triton(*args, **kw)
        assert kinds[-2:] == [2, f16_kind]
        want = dataclasses.replace(dq, q=q.float()).ref(decode=True)
        assert got.dtype == torch.bfloat16 and got.isfinite().all()
        assert_close(got, want, atol=4e-3, rtol=8e-3)
        assert_close(got, plain, atol=4e-3, rtol=8e-3)
    # the default mode follows the tiles: fp16 tiles take DECODE_PREFETCH["e2m1_f16"]
    modes = []
    real_prefetch = pak._prefetch
    monkeypatch.setattr(
        pak, "_prefetch", lambda *a, **k: modes.append(real_prefetch(*a, **k)) or modes[-1]
    )
    for on in (False, True):
        monkeypatch.setattr(pak, "FP4_F16_TILES", on)
        paged_attention_decode_triton(*args, scale=c.scale, num_splits=2, tile_n=16, kv_layout=fmt)
    assert modes == [pak.DECODE_PREFETCH["e2m1"], pak.DECODE_PREFETCH["e2m1_f16"]]
    assert pak.decode_key(fmt, f16_kind) == "e2m1_f16" and pak.decode_key(fmt, 2) == "e2m1"
    assert pak.decode_key(None, 0) is None
    geo = kv_geometry(k_raw, v_raw, 64, fmt)
    assert real(geo._replace(stride_kh=geo.stride_kh + 2), q, k_raw, v_raw) == 2
    assert real(geo._replace(sf_kind=0), q, k_raw, v_raw) == 2
    assert real(geo, q.float(), k_raw, v_raw) == 2


def _gpu_cases(kind, gen, case_seed, kv_lens):
    """``(decode, quantized_case(...))`` for decode rows (one query each) then prefill rows
    (query counts drawn from ``gen``) over ``kv_lens``: 4 KV heads x 4 queries x 128,
    16-token blocks."""
    q_lens = [int(torch.randint(1, n + 1, (), generator=gen)) for n in kv_lens]
    for decode in (True, False):
        yield decode, quantized_case(
            kind, case_seed, kv_lens, [1] * len(kv_lens) if decode else q_lens,
            num_kv_heads=4, group=4, head_dim=128, block_size=16,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4", "fp4_nib"])
def test_gpu_quantized_pages_equal_dequantized_bf16_cache(kind, monkeypatch):
    """On the GPU the kernels over quantized pages equal the same kernels over a bf16 copy of
    the dequantized cache up to the order of the fp32 sums inside the tensor-core MMAs (the
    dequantized tiles themselves are bit-exact: the test above) and, for decode launches in
    mode 2 (fp8 / int8 by default), the bf16 rounding of the scaled probabilities in place of
    the dequantized V: within two bf16 ulps; both are within bf16 tolerance of the float64
    reference over the dequantized values. fp4 decode reads fp16 tiles (``FP4_F16_TILES``;
    fp4_nib: in nibble order, ``FP4_NIBBLE_TILES``)."""
    monkeypatch.setattr(pak, "FP4_NIBBLE_TILES", kind == "fp4_nib")
    kind = kind.removesuffix("_nib")
    gen = torch.Generator().manual_seed(3)
    kv_lens = torch.randint(1, 900, (20,), generator=gen).tolist() + [1, 16, 17]
    for decode, (c, (k_raw, v_raw), fmt, dq) in _gpu_cases(kind, gen, 5, kv_lens):
        cuda = lambda t: t.cuda()  # noqa: E731
        q = c.q.bfloat16().cuda()
        pages = (cuda(c.page_ids), cuda(c.page_start))
        bf = (dq.k_cache.bfloat16().cuda(), dq.v_cache.bfloat16().cuda())
        if decode:
            got = paged_attention_decode(q, cuda(k_raw), cuda(v_raw), *pages, cuda(c.kv_lens),
                                         scale=c.scale, kv_layout=fmt, num_splits=3)  # fmt: skip
            want = paged_attention_decode(q, *bf, *pages, cuda(c.kv_lens), scale=c.scale,
                                          num_splits=3)  # fmt: skip
        else:
            cu = cuda(c.cu_seqlens_q)
            got = paged_attention_prefill(q, cuda(k_raw), cuda(v_raw), *pages, cu,
                                          cuda(c.kv_lens), scale=c.scale, kv_layout=fmt)  # fmt: skip
            want = paged_attention_prefill(q, *bf, *pages, cu, cuda(c.kv_lens), scale=c.scale)
        assert torch.isfinite(got).all()
        assert_close(got, want, atol=4e-3, rtol=8e-3)  # 1 bf16 ulp of |x| < 4 is <= 2 ** -6
        k32, v32 = (t.float().cpu() for t in bf)
        ref = dataclasses.replace(c, q=q.float().cpu(), k_cache=k32, v_cache=v32).ref(decode)
        assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8", "fp4"])
def test_gpu_prefetched_tiles_equal_the_plain_loop(kind):
    """Loading the bytes a tile ahead (mode 1) changes when they are loaded, not the
    arithmetic: decode and prefill at the engine's tilings equal the plain loop within one
    bf16 ulp (on the H200 the compiled loops are not bit-identical: the two schedules round
    some outputs apart). Mode 2 rounds the scaled probabilities instead of the dequantized V
    to bf16: within two bf16 ulps of the plain loop."""
    gen = torch.Generator().manual_seed(4)
    kv_lens = torch.randint(1, 2000, (24,), generator=gen).tolist()
    for decode, (c, (k_raw, v_raw), fmt, _) in _gpu_cases(kind, gen, 6, kv_lens):
        args = (c.q.bfloat16().cuda(), k_raw.cuda(), v_raw.cuda(), c.page_ids.cuda(),
                c.page_start.cuda())  # fmt: skip
        outs = []
        for prefetch in (0, 1, 2):
            if decode:
                outs.append(paged_attention_decode_triton(
                    *args, c.kv_lens.cuda(), scale=c.scale, kv_layout=fmt, prefetch=prefetch))  # fmt: skip
            else:
                outs.append(paged_attention_prefill_triton(
                    *args, c.cu_seqlens_q.cuda(), c.kv_lens.cuda(), scale=c.scale,
                    kv_layout=fmt, prefetch=prefetch))  # fmt: skip
        assert_close(outs[1].float(), outs[0].float(), atol=2e-3, rtol=4e-3)
        assert (outs[1] != outs[0]).float().mean() < 0.01  # rounding, not a different result
        assert_close(outs[2].float(), outs[0].float(), atol=4e-3, rtol=8e-3)


def _decode_args(kind, seed, kv_lens, device, **kw):
    """``(args, scale, layout)`` of a decode call over ``kind`` pages ("bf16": a float cache of
    the fp8-dequantized values) with one query per sequence, on ``device`` (CUDA: bf16 query
    and float cache; CPU: fp32)."""
    qkind = "fp8" if kind == "bf16" else kind
    c, (k_raw, v_raw), fmt, dq = quantized_case(qkind, seed, kv_lens, [1] * len(kv_lens),
                                                block_size=16, **kw)  # fmt: skip
    half = (lambda t: t.bfloat16()) if device == "cuda" else (lambda t: t)  # noqa: E731
    caches = (half(dq.k_cache), half(dq.v_cache)) if kind == "bf16" else (k_raw, v_raw)
    args = tuple(t.to(device) for t in (half(c.q), *caches, c.page_ids, c.page_start,
                                        c.kv_lens))  # fmt: skip
    return args, c.scale, None if kind == "bf16" else fmt


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "fp4", "bf16"])
def test_gpu_register_cap_keeps_the_decode_result(kind):
    """A register cap (``maxnreg``: spills, more programs an SM) changes where values live,
    not the arithmetic: capped decode launches equal the uncapped ones within one bf16 ulp."""
    kv_lens = torch.randint(1, 2000, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    args, scale, layout = _decode_args(kind, 8, kv_lens, "cuda", num_kv_heads=4, group=4,
                                       head_dim=128)  # fmt: skip
    outs = [paged_attention_decode_triton(*args, scale=scale, kv_layout=layout, maxnreg=cap,
                                          num_splits=3) for cap in (0, 168, 128)]  # fmt: skip
    for out in outs[1:]:
        assert_close(out.float(), outs[0].float(), atol=2e-3, rtol=4e-3)


def test_prefetch_defaults_per_format_and_kernel(monkeypatch):
    """``prefetch=None`` takes the module switch, else (decode) ``KVPLAN_DECODE_PREFETCH``, else
    the per-format decode table (``DECODE_PREFETCH``); an explicit argument wins; a mode
    outside 0 / 1 / 2 / 3 is refused, naming the value."""
    from kvplan.cache.kv_tensors import KVCacheTensors
    from kvplan.ops import _paged_attention_kernels as pak

    layout = {
        f: KVCacheTensors(1, 1, 16, 1, 32, kv_format=f).layout for f in ("fp8", "int8", "fp4")
    }
    monkeypatch.setattr(pak, "QUANT_PREFETCH", None)
    for lay in layout.values():
        assert pak._prefetch(None, lay, decode=True) == pak.DECODE_PREFETCH.get(
            lay.quantized_dtype, 0
        )
        assert pak._prefetch(None, lay, decode=False) == 0
    assert pak._prefetch(None, None, decode=True) == 0
    assert pak._prefetch(True, layout["fp8"], decode=False) == 1
    assert pak._prefetch(2, layout["fp4"], decode=True) == 2
    assert pak._prefetch(False, layout["fp4"], decode=True) == 0
    assert pak._prefetch(2, layout["fp8"], decode=True) == 2
    with pytest.raises(ValueError, match="prefetch must be one of .* got 3"):
        pak._prefetch(3, layout["fp8"], decode=True)
    monkeypatch.setattr(pak, "QUANT_PREFETCH", 0)
    assert pak._prefetch(None, layout["fp4"], decode=True) == 0
    monkeypatch.setattr(pak, "QUANT_PREFETCH", 2)
    assert pak._prefetch(None, layout["fp8"], decode=False) == 2
    monkeypatch.setenv("KVPLAN_QUANT_PREFETCH", "0")
    assert pak._env_prefetch() == 0
    monkeypatch.setenv("KVPLAN_QUANT_PREFETCH", "2")
    assert pak._env_prefetch() == 2
    monkeypatch.setenv("KVPLAN_DECODE_PREFETCH", "1")
    assert pak._env_prefetch("KVPLAN_DECODE_PREFETCH") == 1
    monkeypatch.setenv("KVPLAN_DECODE_PREFETCH", "3")
    with pytest.raises(ValueError, match="KVPLAN_DECODE_PREFETCH must be 0, 1 or 2, got '3'"):
        pak._env_prefetch("KVPLAN_DECODE_PREFETCH")
    monkeypatch.setattr(pak, "QUANT_PREFETCH", None)
    monkeypatch.setattr(pak, "DECODE_PREFETCH_OVERRIDE", 1)  # decode launches only
    assert pak._prefetch(None, layout["fp8"], decode=True) == 1
    assert pak._prefetch(None, layout["fp8"], decode=False) == 0
    assert pak._prefetch(None, None, decode=True) == 0
    monkeypatch.setattr(pak, "DECODE_PREFETCH_OVERRIDE", None)
    monkeypatch.setenv("KVPLAN_QUANT_PREFETCH", "yes")
    with pytest.raises(ValueError, match="KVPLAN_QUANT_PREFETCH must be 0, 1 or 2, got 'yes'"):
        pak._env_prefetch()
    monkeypatch.setenv("KVPLAN_QUANT_PREFETCH", "")
    assert pak._env_prefetch() is None
