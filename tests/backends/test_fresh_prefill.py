"""Which context rows take the flash path (host logic), and the split around it, on the CPU.

The flash kernel itself needs a GPU (``test_fresh_prefill_gpu.py``); here a float64 stand-in
with the same contract replaces it, so the split (paged rows first, flash rows rebased) and
the planners' ``fresh_from`` are checked against the dense reference without one. The SDPA
path, which comes before flash, is switched off here (``test_sdpa_prefill.py`` covers it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import SeqSpec, fill_metadata, make_scenario, reference_attention

import kvplan.backends.fresh_prefill as fp
from kvplan.backends import get_backend
from kvplan.backends.fresh_prefill import first_fresh_row, fresh_split
from kvplan.ops.flash_prefill import VarlenApi, flash_prefill_unsupported

PAGED = ["ragged", "block_offsets"]


@pytest.fixture(autouse=True)
def _sdpa_off(monkeypatch):
    monkeypatch.setenv("KVPLAN_PREFILL_SDPA", "0")


def test_first_fresh_row_matches_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 8))
        cached = rng.integers(0, 3, n) * rng.integers(0, 2, n)
        expect = n
        while expect > 0 and cached[expect - 1] == 0:
            expect -= 1
        assert first_fresh_row(cached) == expect, cached


def test_fresh_split_matches_a_loop():
    rng = np.random.default_rng(1)
    for _ in range(200):
        lens = rng.integers(1, 50, int(rng.integers(1, 7)))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        j = int(rng.integers(0, lens.size + 1))
        split = fresh_split(cu, j)
        if j == lens.size:
            assert split is None
            continue
        assert split.num_paged_rows == j
        assert split.num_paged_tokens == sum(lens[:j])
        assert split.paged_max_q_len == (max(lens[:j]) if j else 0)
        assert split.flash_max_q_len == max(lens[j:])


def _api(window=True, gqa=True):
    return VarlenApi(lambda *a, **k: None, window, gqa)


def _qkv(dtype=torch.bfloat16, h=8, hkv=2, d=64):
    return torch.zeros(4, h, d, dtype=dtype), *(torch.zeros(4, hkv, d, dtype=dtype),) * 2


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"device_type": "cpu"}, "not a CUDA tensor"),
        ({"quantized_cache": True}, "quantized cache"),
        ({"dtype": torch.float32, "cache_dtype": torch.float32}, "dtype torch.float32"),
        ({"cache_dtype": torch.float16}, "dtypes differ"),
        ({"d": 72}, None),
        ({"d": 20}, "head_dim 20"),
        ({"d": 512}, "head_dim 512"),
        ({"hkv": 3, "h": 8}, "heads 8 not a multiple"),
        ({"api": None}, "torch has no varlen_attn"),
        ({"sliding_window": 16}, None),
        ({"sliding_window": 16, "api": _api(window=False)}, "sliding window"),
        ({"sliding_window": 100, "api": _api(window=False)}, None),  # window >= every run
        ({"env": "0"}, "KVPLAN_PREFILL_FLASH=0"),
        ({"env": "1"}, None),
    ],
)
def test_flash_decision_table(change, reason, monkeypatch):
    """Each host fact that rules the flash path out, one at a time (no GPU needed)."""
    import kvplan.ops.flash_prefill as flash

    c = dict(change)
    if "env" in c:
        monkeypatch.setenv("KVPLAN_PREFILL_FLASH", c.pop("env"))
    else:
        monkeypatch.delenv("KVPLAN_PREFILL_FLASH", raising=False)
    dtype = c.pop("dtype", torch.bfloat16)
    shape = {key: c.pop(key) for key in ("h", "hkv", "d") if key in c}
    q, k, v = _qkv(dtype, **shape)
    api = c.pop("api", _api())
    monkeypatch.setattr(flash, "varlen_api", lambda: api)
    kw = dict(cache_dtype=dtype, quantized_cache=False, sliding_window=None, max_q_len=64,
              device_type="cuda")  # fmt: skip
    kw.update(c)
    got = flash_prefill_unsupported(q, k, v, **kw)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("KVPLAN_PREFILL_FLASH", "yes")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="KVPLAN_PREFILL_FLASH"):
        flash_prefill_unsupported(
            q, k, v, cache_dtype=q.dtype, quantized_cache=False, sliding_window=None,
            max_q_len=4, device_type="cuda",
        )  # fmt: skip


def dense_causal(q, k, v, cu_seqlens, max_q_len, *, scale, sliding_window=None, calls=None):
    """Float64 stand-in for ``flash_prefill`` (same contract), recording its arguments."""
    cu = cu_seqlens.tolist()
    if calls is not None:
        calls.append((cu, max_q_len, q.shape[0]))
    assert cu[0] == 0 and cu[-1] == q.shape[0] == k.shape[0]
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        assert b - a <= max_q_len
        qq = q[a:b].double()
        kk = k[a:b].double().repeat_interleave(group, 1)
        vv = v[a:b].double().repeat_interleave(group, 1)
        s = torch.einsum("ihd,jhd->hij", qq, kk) * scale
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        ok = j <= i
        if sliding_window is not None:
            ok &= j > i - sliding_window
        s = s.masked_fill(~ok, float("-inf"))
        out[a:b] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)
    return out.to(q.dtype)


def _run(name, sc, window=None):
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=16, max_num_tokens=512, max_num_sequences=32,
        kv_cache_manager=sc.manager, kv_cache=sc.kv, device=sc.q.device,
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    attn = cls(0, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window)
    return md, attn.forward(sc.q, sc.k[0], sc.v[0], md)


SPLITS = [
    # (specs, first fresh context row, flash calls' rebased cu_seqlens)
    ([SeqSpec(9, 5, True), SeqSpec(0, 7, True), SeqSpec(0, 3, True)], 1, [[0, 7, 10]]),
    ([SeqSpec(0, 6, True), SeqSpec(0, 4, True), SeqSpec(5, 1, False)], 0, [[0, 6, 10]]),
    ([SeqSpec(0, 6, True), SeqSpec(4, 3, True), SeqSpec(7, 1, False)], 2, []),
    ([SeqSpec(0, 6, True), SeqSpec(4, 3, True), SeqSpec(0, 2, True)], 2, [[0, 2]]),
]


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize(("specs", "fresh_from", "flash_cu"), SPLITS)
@pytest.mark.parametrize("window", [None, 4])
def test_split_matches_reference_with_a_stand_in_kernel(
    name, specs, fresh_from, flash_cu, window, monkeypatch
):
    """Force the flash decision on CPU and replace the kernel with ``dense_causal``: the
    paged rows and the flash rows together equal the dense reference, and the flash rows'
    cu_seqlens are rebased to 0."""
    calls = []
    monkeypatch.setattr(fp, "flash_prefill_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(fp, "flash_prefill", lambda *a, **k: dense_causal(*a, **k, calls=calls))
    sc = make_scenario(3, specs, num_heads=4, num_kv_heads=2, head_dim=16)
    md, out = _run(name, sc, window)
    assert md.paged_view(0).context.fresh_from == fresh_from
    assert [c[0] for c in calls] == flash_cu
    torch.testing.assert_close(out.double(), reference_attention(sc, 0, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", PAGED)
def test_cpu_path_never_calls_flash(name, monkeypatch):
    """On CPU tensors the decision says no: the torch paged path runs as before."""
    monkeypatch.delenv("KVPLAN_PREFILL_FLASH", raising=False)

    def boom(*a, **k):
        raise AssertionError("flash_prefill called on CPU")

    monkeypatch.setattr(fp, "flash_prefill", boom)
    sc = make_scenario(5, [SeqSpec(0, 9, True), SeqSpec(0, 4, True)], head_dim=16)
    _, out = _run(name, sc)
    torch.testing.assert_close(out.double(), reference_attention(sc, 0, None), atol=1e-5, rtol=0)


def test_failed_first_use_falls_back(monkeypatch):
    """A flash kernel that returns None (failed probe) leaves the paged kernel to run."""
    monkeypatch.setattr(fp, "flash_prefill_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(fp, "flash_prefill", lambda *a, **k: None)
    sc = make_scenario(6, [SeqSpec(3, 5, True), SeqSpec(0, 4, True)], head_dim=16)
    _, out = _run("ragged", sc)
    torch.testing.assert_close(out.double(), reference_attention(sc, 0, None), atol=1e-5, rtol=0)
