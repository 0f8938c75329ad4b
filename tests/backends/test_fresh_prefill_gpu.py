"""The flash and SDPA prefill paths on a GPU: against the paged Triton kernel and an fp32
reference.

Also checks that each path actually engages on the installed torch (a silent fallback would
pass the equality tests), and the backends with the switches on and off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from backends_testlib import SeqSpec, fill_metadata, make_scenario, reference_attention

import kvplan.backends.fresh_prefill as fp
import kvplan.ops.sdpa_prefill as sdpa_mod
from kvplan.backends import get_backend
from kvplan.backends.page_table_attention import PagedSegment
from kvplan.ops.flash_prefill import flash_prefill, flash_prefill_unsupported, varlen_api
from kvplan.ops.paged_attention import paged_attention_prefill_triton
from kvplan.ops.sdpa_prefill import (
    equal_length_groups,
    sdpa_prefill,
    sdpa_prefill_unsupported,
    sdpa_takes_enable_gqa,
)

pytestmark = pytest.mark.gpu


def rel_err(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def ragged_case(seed, lens, h, hkv, d, dtype, block_size=16):
    """Fresh rows q/k/v ``[T, *, D]`` plus the same K/V scattered into a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, h, d, generator=gen).to(dtype).cuda()
    k = torch.randn(total, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(total, hkv, d, generator=gen).to(dtype).cuda()
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).cuda()
    v_cache = torch.randn_like(k_cache)
    page_ids, page_start, blocks, rows = [], [], [], []
    for n in lens:
        page_start.append(len(page_ids))
        ids = perm[len(page_ids) : len(page_ids) + -(-n // block_size)]
        page_ids += ids
        blocks += [ids[i // block_size] for i in range(n)]
        rows += [i % block_size for i in range(n)]
    blocks, rows = torch.tensor(blocks).cuda(), torch.tensor(rows).cuda()
    k_cache[blocks, rows] = k
    v_cache[blocks, rows] = v
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    i32 = dict(dtype=torch.int32, device="cuda")
    paged = (k_cache, v_cache, torch.tensor(page_ids, **i32), torch.tensor(page_start, **i32),
             cu, torch.tensor(lens, **i32))  # fmt: skip
    return q, k, v, cu, paged


def fp32_reference(q, k, v, lens, scale, window):
    out, t = torch.empty(q.shape, dtype=torch.float32, device=q.device), 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qq = q[t : t + n].float().transpose(0, 1)[None]  # [1, H, n, D]
        kk = k[t : t + n].float().repeat_interleave(group, 1).transpose(0, 1)[None]
        vv = v[t : t + n].float().repeat_interleave(group, 1).transpose(0, 1)[None]
        i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)
        ok = j <= i
        if window is not None:
            ok &= j > i - window
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=ok, scale=scale)
        out[t : t + n] = o[0].transpose(0, 1)
        t += n
    return out


def test_gpu_flash_path_engages():
    """On this torch and GPU the decision says yes and the kernel runs (no fallback)."""
    assert varlen_api() is not None, "torch.nn.attention.varlen.varlen_attn is missing"
    q, k, v, cu, _ = ragged_case(0, [64, 100], 8, 2, 128, torch.bfloat16)
    why = flash_prefill_unsupported(
        q, k, v, cache_dtype=q.dtype, quantized_cache=False, sliding_window=None, max_q_len=100
    )
    assert why is None, why
    assert flash_prefill(q, k, v, cu, 100, scale=128**-0.5) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(8, 2, 128), (4, 4, 64), (16, 1, 256)])
@pytest.mark.parametrize("window", [None, 37])
def test_gpu_flash_equals_triton_and_reference(dtype, h, hkv, d, window):
    lens = [1, 17, 300, 1000, 64, 129]
    q, k, v, cu, paged = ragged_case(1, lens, h, hkv, d, dtype)
    scale = d**-0.5
    api = varlen_api()
    if window is not None and not api.has_window:
        pytest.skip("this torch's varlen_attn has no window_size (the Triton path serves it)")
    flash = flash_prefill(q, k, v, cu, max(lens), scale=scale, sliding_window=window)
    assert flash is not None
    triton = paged_attention_prefill_triton(
        q, *paged, scale=scale, sliding_window=window, max_q_len=max(lens), check=True
    )
    ref = fp32_reference(q, k, v, lens, scale, window)
    torch.cuda.synchronize()
    assert flash.dtype == dtype and flash.shape == q.shape
    assert rel_err(flash, ref) < 1e-2
    assert rel_err(triton, ref) < 1e-2
    assert rel_err(flash, triton) < 1e-2


def _run(name, sc, layer, window):
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=64, max_num_tokens=4096, max_num_sequences=128,
        kv_cache_manager=sc.manager, kv_cache=sc.kv, device=sc.q.device,
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    attn = cls(layer, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window)
    return attn.forward(sc.q, sc.k[layer], sc.v[layer], md)


@pytest.mark.parametrize("name", ["ragged", "block_offsets"])
@pytest.mark.parametrize("switch", ["1", "0"])
@pytest.mark.parametrize("sdpa", ["0", "1"])
def test_gpu_backend_switch(name, switch, sdpa, monkeypatch):
    """A mixed step (continuing chunk, two fresh prompts, decode rows) with the switches on
    and off: all equal the reference; SDPA runs on the fresh rows when on (the unwindowed
    layer: the window of 96 is shorter than the prompts), flash where SDPA did not and the
    flash switch is on."""
    monkeypatch.setenv("KVPLAN_PREFILL_FLASH", switch)
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", sdpa)
    ran, ran_sdpa = [], []
    orig, orig_sdpa = fp.flash_prefill, fp.sdpa_prefill
    monkeypatch.setattr(
        fp, "flash_prefill", lambda *a, **k: ran.append(a[3].tolist()) or orig(*a, **k)
    )
    monkeypatch.setattr(
        fp, "sdpa_prefill", lambda *a, **k: ran_sdpa.append(list(a[3])) or orig_sdpa(*a, **k)
    )
    specs = [SeqSpec(200, 50, True), SeqSpec(0, 300, True), SeqSpec(0, 123, True)]
    specs += [SeqSpec(40 + 17 * i, 1, False) for i in range(6)]
    windows = (None, 96)
    sc = make_scenario(
        2, specs, layer_windows=windows, num_heads=16, num_kv_heads=4, head_dim=128,
        block_size=16, num_blocks=1024, max_blocks_per_seq=64, kv_format="bf16",
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    for layer, window in enumerate(windows):
        out = _run(name, sc, layer, window)
        torch.cuda.synchronize()
        assert rel_err(out, reference_attention(sc, layer, window)) < 1e-2
    assert ran_sdpa == ([[(0, 1, 300), (300, 1, 123)]] if sdpa == "1" else [])
    if switch == "0":
        assert ran == []
    else:
        num_flash = (sdpa == "0") + varlen_api().has_window
        assert ran == [[0, 300, 423]] * num_flash


def test_gpu_sdpa_path_engages(monkeypatch):
    """By default on CUDA the SDPA decision says yes and the kernel runs (no fallback), with
    native GQA where torch takes ``enable_gqa``."""
    monkeypatch.delenv("KVPLAN_PREFILL_SDPA", raising=False)
    monkeypatch.setattr(sdpa_mod, "_probed", {})
    q, k, v, cu, _ = ragged_case(0, [64, 64, 100], 8, 2, 128, torch.bfloat16)
    groups = equal_length_groups(cu.cpu().numpy())
    why = sdpa_prefill_unsupported(
        q, k, v, groups, cache_dtype=q.dtype, quantized_cache=False, sliding_window=None
    )
    assert why is None, why
    assert sdpa_prefill(q, k, v, groups, scale=128**-0.5) is not None
    mode = sdpa_mod._probed[(q.device, q.dtype, 128, True)]
    assert mode == ("native" if sdpa_takes_enable_gqa() else "expand")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("h", "hkv", "d"), [(8, 2, 128), (4, 4, 64), (16, 1, 256)])
def test_gpu_sdpa_equals_triton_and_reference(dtype, h, hkv, d):
    lens = [1, 17, 17, 300, 1000, 64, 64, 64, 129]
    q, k, v, cu, paged = ragged_case(2, lens, h, hkv, d, dtype)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    res = sdpa_prefill(q, k, v, equal_length_groups(np.cumsum([0, *lens])), scale=scale, out=out)
    if res is None and dtype == torch.float32:  # no fused fp32 kernel for this head_dim
        assert sdpa_mod._probed[(q.device, dtype, d, h != hkv)] is False
        pytest.skip(f"no fused SDPA kernel for fp32, head_dim {d} (the engine falls back)")
    assert res is out
    triton = paged_attention_prefill_triton(q, *paged, scale=scale, max_q_len=max(lens), check=True)
    ref = fp32_reference(q, k, v, lens, scale, None)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, triton) < 1e-2


def test_gpu_sdpa_real_size_matches_triton(monkeypatch):
    """B=4 x 4096 fresh prompts, 32 / 8 heads x 64, bf16, through ``prefill_fresh_rows``
    (SDPA on by default) into a preallocated output, against the Triton kernel."""
    monkeypatch.delenv("KVPLAN_PREFILL_SDPA", raising=False)
    lens = [4096] * 4
    q, k, v, cu, paged = ragged_case(3, lens, 32, 8, 64, torch.bfloat16)
    k_cache, v_cache, page_ids, page_start, _, kv_lens = paged
    seg = PagedSegment(page_ids, page_start, kv_lens, cu, sum(lens), 4096, 4096,
                       np.cumsum([0, *lens]).astype(np.int32), 0)  # fmt: skip
    ran = []
    orig = fp.sdpa_prefill
    monkeypatch.setattr(fp, "sdpa_prefill", lambda *a, **kw: ran.append(a[3]) or orig(*a, **kw))
    out = torch.full_like(q, float("nan"))
    res = fp.prefill_fresh_rows(
        q, k, v, k_cache, v_cache, seg, scale=0.125, window=None, out=out, kv_layout=None,
        check=False,
    )  # fmt: skip
    assert res is out and [list(g) for g in ran[0]] == [[0, 4, 4096]]
    triton = paged_attention_prefill_triton(q, *paged, scale=0.125, max_q_len=4096, check=True)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_err(out, triton) < 1e-2
