"""The SDPA prefill path on the CPU: grouping, the op against a dense loop, the decision rules,
and the backends with the path forced on (``KVPLAN_PREFILL_SDPA=1``; CPU's default is off)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from backends_testlib import SeqSpec, fill_metadata, make_scenario, reference_attention

import kvplan.backends.fresh_prefill as fp
import kvplan.ops.sdpa_prefill as sp
from kvplan.backends import get_backend
from kvplan.ops.sdpa_prefill import (
    SeqGroup,
    equal_length_groups,
    sdpa_prefill,
    sdpa_prefill_unsupported,
)

PAGED = ["ragged", "block_offsets"]


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    """Each test starts with no probe results (and restores the module's afterwards)."""
    monkeypatch.setattr(sp, "_probed", {})


def test_groups_match_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lens = rng.integers(0, 4, int(rng.integers(0, 9)))
        start = int(rng.integers(0, 5))
        cu = start + np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        expect, t = [], start
        for n in lens.tolist():
            if n and expect and expect[-1][2] == n and expect[-1][0] + expect[-1][1] * n == t:
                expect[-1][1] += 1
            elif n:
                expect.append([t, 1, n])
            t += n
        got = equal_length_groups(cu)
        assert [list(g) for g in got] == expect, lens
        for g in got:  # the rows of a group are contiguous
            assert g.end == g.start + g.num_seqs * g.seq_len


def dense_reference(q, k, v, lens, scale):
    """Float64 causal attention, one sequence and one query at a time."""
    group = q.shape[1] // k.shape[1]
    out, t = torch.zeros(q.shape, dtype=torch.float64), 0
    for n in lens:
        for i in range(n):
            kk = k[t : t + i + 1].double().repeat_interleave(group, 1)  # [i + 1, H, D]
            vv = v[t : t + i + 1].double().repeat_interleave(group, 1)
            s = torch.einsum("hd,jhd->hj", q[t + i].double(), kk) * scale
            out[t + i] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), vv)
        t += n
    return out


def packed_rows(seed, total, h, hkv, d):
    """q ``[T, H, D]`` and k, v ``[T, Hkv, D]`` as strided slices of one fused projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(total, (h + 2 * hkv) * d, generator=gen)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=1)
    return q.view(total, h, d), k.view(total, hkv, d), v.view(total, hkv, d)


LENS = [
    [5, 5, 5, 3, 3, 1, 7, 7, 2],  # several groups, a length-1 sequence
    [1],
    [13],
    [1, 1, 1, 1],
    [9, 4, 9, 9, 17],
]


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize(("h", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("native", [True, False])
def test_op_matches_dense_reference(lens, h, hkv, native, monkeypatch):
    """fp32 SDPA per group, written at an offset of a larger preallocated output: the
    group rows equal the dense loop, every other row is left alone."""
    if not native:
        monkeypatch.setattr(sp, "sdpa_takes_enable_gqa", lambda: False)
    d, scale, offset = 16, 0.3, 3
    q, k, v = packed_rows(sum(lens) + len(lens), sum(lens), h, hkv, d)
    groups = equal_length_groups(np.concatenate([[0], np.cumsum(lens)]))
    assert groups[-1].end == sum(lens)
    out = torch.full((sum(lens) + offset + 2, h, d), float("nan"))
    res = sdpa_prefill(q, k, v, groups, scale=scale, out=out[offset : offset + sum(lens)])
    assert res is not None and res.data_ptr() == out[offset].data_ptr()
    ref = dense_reference(q, k, v, lens, scale)
    torch.testing.assert_close(out[offset : offset + sum(lens)].double(), ref, atol=1e-5, rtol=0)
    assert out[:offset].isnan().all() and out[offset + sum(lens) :].isnan().all()
    mode = sp._probed[(q.device, q.dtype, d, h != hkv)]
    assert mode == ("native" if native and h != hkv else "expand")


def test_op_allocates_when_no_out():
    q, k, v = packed_rows(7, 12, 8, 2, 16)
    res = sdpa_prefill(q, k, v, [SeqGroup(0, 3, 4)], scale=0.25)
    torch.testing.assert_close(res.double(), dense_reference(q, k, v, [4] * 3, 0.25), atol=1e-5,
                               rtol=0)  # fmt: skip


def test_failed_probe_returns_none_and_is_remembered(monkeypatch):
    """A kernel error at first use (native and expanded) marks the key; no later call."""
    calls = []

    def fail(*a, **k):
        calls.append(k.get("enable_gqa", False))
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(sp.F, "scaled_dot_product_attention", fail)
    q, k, v = packed_rows(1, 8, 8, 2, 16)
    groups = [SeqGroup(0, 2, 4)]
    assert sdpa_prefill(q, k, v, groups, scale=1.0) is None
    assert calls == [True, False]  # native first, then expanded
    assert sdpa_prefill(q, k, v, groups, scale=1.0) is None
    assert calls == [True, False]


def _qkv(dtype=torch.bfloat16, h=8, hkv=2, d=64):
    return torch.zeros(4, h, d, dtype=dtype), *(torch.zeros(4, hkv, d, dtype=dtype),) * 2


SMALL = [SeqGroup(0, 2, 64)]
MANY_SHORT = [SeqGroup(i * 10, 1, 10 + i) for i in range(sp.MAX_GROUPS + 1)]
MANY_LONG = [SeqGroup(i * 4096, 1, 600 + i) for i in range(sp.MAX_GROUPS + 1)]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"env": "0"}, "KVPLAN_PREFILL_SDPA off"),
        ({"env": "1"}, None),
        ({"device_type": "cpu"}, "KVPLAN_PREFILL_SDPA off for cpu"),  # CPU default: off
        ({"device_type": "cpu", "env": "1"}, None),
        ({"device_type": "mps", "env": "1"}, "device mps"),
        ({"quantized_cache": True}, "quantized cache"),
        ({"dtype": torch.float32, "cache_dtype": torch.float32}, None),
        ({"dtype": torch.float64, "cache_dtype": torch.float64}, "dtype torch.float64"),
        ({"cache_dtype": torch.float16}, "dtypes differ"),
        ({"d": 72}, None),
        ({"d": 20}, "head_dim 20"),
        ({"d": 512}, "head_dim 512"),
        ({"hkv": 3, "h": 8}, "heads 8 not a multiple"),
        ({"sliding_window": 16}, "sliding window 16 < 64"),
        ({"sliding_window": 64}, None),  # window covers every sequence
        ({"groups": []}, "no rows"),
        ({"groups": MANY_SHORT}, f"{sp.MAX_GROUPS + 1} length groups"),
        ({"groups": MANY_LONG}, None),
    ],
)
def test_sdpa_decision_table(change, reason, monkeypatch):
    """Each host fact that rules the SDPA path out, one at a time."""
    c = dict(change)
    if "env" in c:
        monkeypatch.setenv("KVPLAN_PREFILL_SDPA", c.pop("env"))
    else:
        monkeypatch.delenv("KVPLAN_PREFILL_SDPA", raising=False)
    dtype = c.pop("dtype", torch.bfloat16)
    shape = {key: c.pop(key) for key in ("h", "hkv", "d") if key in c}
    q, k, v = _qkv(dtype, **shape)
    kw = dict(cache_dtype=dtype, quantized_cache=False, sliding_window=None, device_type="cuda")
    groups = c.pop("groups", SMALL)
    kw.update(c)
    got = sdpa_prefill_unsupported(q, k, v, groups, **kw)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "on")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="KVPLAN_PREFILL_SDPA"):
        sdpa_prefill_unsupported(
            q, k, v, SMALL, cache_dtype=q.dtype, quantized_cache=False, sliding_window=None
        )


def _run(name, sc, window=None):
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=16, max_num_tokens=512, max_num_sequences=32,
        kv_cache_manager=sc.manager, kv_cache=sc.kv, device=sc.q.device,
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    attn = cls(0, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window)
    return attn.forward(sc.q, sc.k[0], sc.v[0], md)


def _record(monkeypatch):
    """Record SDPA calls' groups; make any flash call fail the test."""
    calls = []
    orig = fp.sdpa_prefill

    def spy(q, k, v, groups, **kw):
        calls.append([tuple(g) for g in groups])
        return orig(q, k, v, groups, **kw)

    def boom(*a, **k):
        raise AssertionError("flash_prefill called")

    monkeypatch.setattr(fp, "sdpa_prefill", spy)
    monkeypatch.setattr(fp, "flash_prefill", boom)
    return calls


SPLITS = [
    # (specs, the SDPA call's groups, rebased to the first fresh row)
    ([SeqSpec(9, 5, True), SeqSpec(0, 7, True), SeqSpec(0, 7, True), SeqSpec(0, 3, True)],
     [[(0, 2, 7), (14, 1, 3)]]),
    ([SeqSpec(0, 1, True), SeqSpec(0, 6, True), SeqSpec(5, 1, False)], [[(0, 1, 1), (1, 1, 6)]]),
    ([SeqSpec(0, 6, True), SeqSpec(4, 3, True), SeqSpec(7, 1, False)], []),  # no fresh suffix
    ([SeqSpec(0, 6, True), SeqSpec(4, 3, True), SeqSpec(0, 5, True), SeqSpec(0, 5, True)],
     [[(0, 2, 5)]]),
]  # fmt: skip


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize(("specs", "expect"), SPLITS)
@pytest.mark.parametrize("hkv", [4, 1])
def test_backends_with_sdpa_forced_on(name, specs, expect, hkv, monkeypatch):
    """Paged rows first, SDPA on the fresh suffix (groups rebased), decode rows after:
    together equal to the dense reference; flash never runs."""
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "1")
    calls = _record(monkeypatch)
    sc = make_scenario(3, specs, num_heads=4, num_kv_heads=hkv, head_dim=16)
    out = _run(name, sc)
    assert calls == expect
    torch.testing.assert_close(out.double(), reference_attention(sc, 0, None), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("env", "window", "kv_format", "sdpa_runs"),
    [
        ("1", None, "fp32", True),
        ("0", None, "fp32", False),
        (None, None, "fp32", False),  # CPU default
        ("1", 4, "fp32", False),  # window shorter than the prompts: paged kernel
        ("1", 64, "fp32", True),  # window longer than every prompt: no window in effect
        ("1", None, "fp8", True),  # quantized cache: over the dequantized stored rows
        ("1", 4, "fp8", False),
    ],
)
def test_backend_choice(env, window, kv_format, sdpa_runs, monkeypatch):
    monkeypatch.setattr(fp, "STORED_ROWS_MIN_LEN", 1)
    if env is None:
        monkeypatch.delenv("KVPLAN_PREFILL_SDPA", raising=False)
    else:
        monkeypatch.setenv("KVPLAN_PREFILL_SDPA", env)
    calls = _record(monkeypatch)
    specs = [SeqSpec(0, 9, True), SeqSpec(0, 9, True), SeqSpec(0, 4, True)]
    sc = make_scenario(5, specs, head_dim=32, kv_format=kv_format, layer_windows=(window,))
    out = _run("ragged", sc, window)
    assert calls == ([[(0, 2, 9), (18, 1, 4)]] if sdpa_runs else [])
    if kv_format == "fp32":
        ref = reference_attention(sc, 0, window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize("kv_format", ["fp8", "fp4", "int8"])
@pytest.mark.parametrize(("specs", "expect"), SPLITS)
def test_quantized_cache_fresh_rows_equal_the_paged_kernel(name, kv_format, specs, expect,
                                                           monkeypatch):  # fmt: skip
    """A quantized cache's fresh rows on SDPA over their stored (dequantized) values: the same
    attention as the paged kernel reading the pages (SDPA off): both equal the dense
    attention over the stored values within bf16 tolerance; the rows with history and the
    decode rows stay on the paged kernel."""
    sc = make_scenario(7, specs, num_heads=4, num_kv_heads=2, head_dim=32, kv_format=kv_format)
    monkeypatch.setattr(fp, "STORED_ROWS_MIN_LEN", 1)
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "0")
    paged = _run(name, sc)
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "1")
    calls = _record(monkeypatch)
    sc = make_scenario(7, specs, num_heads=4, num_kv_heads=2, head_dim=32, kv_format=kv_format)
    fused = _run(name, sc)
    assert calls == expect
    # the dense float64 attention of the bf16 queries over the values the cache holds
    stored = dataclasses.replace(
        sc, q=sc.q.bfloat16().double(),
        history={layer: [tuple(_stored(x, sc.kv.layout) for x in kv) for kv in rows]
                 for layer, rows in sc.history.items()},
    )  # fmt: skip
    want = reference_attention(stored, 0, None)
    for got in (fused, paged):
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=0)
    if kv_format != "int8":  # and that is not the attention over the exact rows (by 3x atol)
        assert (want - reference_attention(sc, 0, None)).abs().max() > 3e-2


def _stored(x, layout):
    """``[n, Hkv, D]`` rows as a quantized cache holds them (bf16, then the format's
    quantize-dequantize over each token's Hkv * D values)."""
    from kvplan.quant import dequantize, quantize

    flat = x.bfloat16().reshape(x.shape[0], -1)
    return dequantize(*quantize(flat, layout), layout).double().view(x.shape)


def test_read_slots_returns_the_stored_values():
    from kvplan.cache.kv_tensors import KVCacheTensors
    from kvplan.quant import dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    for fmt in ("bf16", "fp8", "fp4", "int8"):
        kv = KVCacheTensors(2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=32,
                            kv_format=fmt)  # fmt: skip
        k, v = (torch.randn(5, 2, 32, generator=gen).bfloat16() for _ in range(2))
        slots = torch.tensor([9, 4, 15, 5, 0])
        kv.store(1, k, v, slots)
        got_k, got_v = kv.read_slots(1, slots[[2, 0, 1]])
        for got, x in ((got_k, k[[2, 0, 1]]), (got_v, v[[2, 0, 1]])):
            assert got.shape == (3, 2, 32) and got.dtype == torch.bfloat16
            if fmt == "bf16":
                assert torch.equal(got, x)
            else:  # independent: the format's quantize-dequantize of the rows
                vals, scales = quantize(x.reshape(3, 64), kv.layout)
                assert torch.equal(got.reshape(3, 64), dequantize(vals, scales, kv.layout))


def test_quantized_short_prompts_keep_the_paged_kernel(monkeypatch):
    """Below ``STORED_ROWS_MIN_LEN`` tokens a quantized cache's fresh rows stay on the paged
    kernel (reading the rows back would cost more than SDPA saves); at it they take SDPA."""
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "1")
    calls = _record(monkeypatch)
    specs = [SeqSpec(0, 9, True), SeqSpec(0, 4, True)]
    for min_len, runs in ((10, False), (9, True)):
        monkeypatch.setattr(fp, "STORED_ROWS_MIN_LEN", min_len)
        calls.clear()
        _run("ragged", make_scenario(5, specs, head_dim=32, kv_format="fp8"))
        assert bool(calls) == runs, min_len
