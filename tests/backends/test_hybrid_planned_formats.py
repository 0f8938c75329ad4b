"""Quantized KV formats of PlannedHybridFamily: the layouts (V41 / index formats at their native
widths, the same layouts at other widths), and equality with the oracle whose stored rows pass
through the same quantize-dequantize."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_oracle import Driver, qdq
from test_hybrid_planned import CSA, HCA, SLIDING, make_family, schedules

from kvplan.backends.hybrid.storage import PagedRows, exact_format, index_format, main_format
from kvplan.formats import (
    FP4_INDEX_KV_FORMAT,
    FP8_FLOAT32_SF_INDEX_KV_FORMAT,
    MXFP8_INDEX_KV_FORMAT,
    V41_FORMAT,
    V41_FP4_FORMAT,
    bf16_format,
)
from kvplan.ops.sparse_sources import KeySource


def test_native_widths_are_the_seed_formats() -> None:
    assert main_format("fp8", 512, torch.bfloat16) is V41_FORMAT
    assert main_format("fp4", 512, torch.float32) is V41_FP4_FORMAT
    assert index_format("fp8", None, 128, torch.float32) is MXFP8_INDEX_KV_FORMAT
    assert index_format("fp8", "fp8_fp32sf", 128, torch.float32) is FP8_FLOAT32_SF_INDEX_KV_FORMAT
    assert index_format("fp4", None, 128, torch.float32) is FP4_INDEX_KV_FORMAT
    assert main_format("exact", 64, torch.float32) == bf16_format(128)
    assert exact_format(64, torch.bfloat16) == bf16_format(64)


def test_other_widths_keep_the_layout() -> None:
    f = main_format("fp8", 64, torch.float32)
    assert (f.quantized_dtype, f.elements, f.elements_per_sf, f.sf_format) == (
        "e4m3",
        64,
        32,
        "ue8m0",
    )
    assert f.do_cast and f.token_interleaved and f.bytes_per_token == 66
    f = main_format("fp4", 64, torch.float32)
    assert (f.quantized_dtype, f.elements_per_sf, f.sf_format, f.bytes_per_token) == (
        "e2m1", 16, "e4m3", 36,
    )  # fmt: skip
    f = index_format("fp8", "fp8_fp32sf", 32, torch.float32)
    assert (f.elements_per_sf, f.sf_format, f.do_cast, f.bytes_per_token) == (32, "fp32", False, 36)
    f = index_format("fp8", "fp4", 32, torch.float32)
    assert (f.quantized_dtype, f.elements_per_sf, f.bytes_per_token) == ("e2m1", 32, 17)
    with pytest.raises(ValueError, match="kv_format"):
        main_format("int8", 64, torch.float32)
    with pytest.raises(ValueError, match="index_format"):
        index_format("fp8", "int4", 64, torch.float32)
    with pytest.raises(ValueError, match="needs a quantized kv_format"):
        index_format("exact", "mxfp8", 64, torch.float32)


@pytest.mark.parametrize("kind", ["exact", "fp8", "fp4"])
@pytest.mark.parametrize("index_kind", [None, "mxfp8", "fp8_fp32sf", "fp4"])
def test_paged_rows_roundtrip(kind: str, index_kind: str | None) -> None:
    """store + load (plan and per-slot) return ``roundtrip``; exact rows keep every fp32 bit."""
    if kind == "exact" and index_kind is not None:
        return
    gen = torch.Generator().manual_seed(3)
    for layout in (main_format(kind, 48, torch.float32),
                   index_format(kind, index_kind, 48, torch.float32)):  # fmt: skip
        rows = PagedRows(5, 4, layout, 48, device=torch.device("cpu"), check=True)
        x = torch.randn(6, 48, generator=gen) * 3
        slots = torch.tensor([4, 5, 19, 7, -1, 8], dtype=torch.int32)
        rows.store(x, slots)
        want = rows.roundtrip(x)
        got = rows.load_slots(torch.tensor([[4, 5, 19], [7, -1, 8]], dtype=torch.int32))
        keep = torch.tensor([0, 1, 2, 3, 5])
        assert torch.equal(got[keep], want[keep]) and torch.equal(got[4], torch.zeros(48))
        segs = torch.tensor([[1, 0, 2, 0], [-1, 0, 1, 2], [4, 3, 4, 3]], dtype=torch.int32)
        loaded = rows.load(segs, 4)
        assert torch.equal(loaded[[0, 1, 3]], want[[0, 1, 2]])
        if kind == "exact":
            assert torch.equal(want, x)
        else:
            assert not torch.equal(want, x)
            if layout.do_cast:  # the oracle's scratch-cache path gives the same rows
                assert torch.equal(qdq(x, layout), want)


@pytest.mark.parametrize("kind,index_kind", [("fp8", None), ("fp4", None), ("fp8", "mxfp8"),
                                             ("fp8", "fp8_fp32sf"), ("fp8", "fp4")])  # fmt: skip
def test_roundtrip_kernels_equal_the_torch_ops(kind, index_kind, monkeypatch) -> None:
    """On the ops' Triton path ``roundtrip`` runs the store and load kernels through a
    scratch cache: bit for bit the torch quantize + dequantize (rows not a multiple of the
    block, large and tiny values, an inf)."""
    layout = (main_format(kind, 64, torch.bfloat16) if index_kind is None
              else index_format(kind, index_kind, 64, torch.bfloat16))  # fmt: skip
    rows = PagedRows(2, 4, layout, 64, device=torch.device("cpu"))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5)) * 3
    x[2, :8] *= 1e4
    x[5, 9] = float("inf")
    sizes = [x, x[:3], torch.cat([x, x.flip(0)]), x[1:6]]  # the scratch reused and grown
    wants = [rows.roundtrip(v) for v in sizes]
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    for v, want in zip(sizes, wants, strict=True):
        got = rows.roundtrip(v)
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want)
    assert torch.equal(rows.cache, torch.zeros_like(rows.cache))  # the cache is untouched


@pytest.mark.parametrize(
    "kv_format,index_kind", [("fp8", None), ("fp8", "fp8_fp32sf"), ("fp4", None), ("fp8", "fp4")]
)
@pytest.mark.parametrize("name", ["chunked", "mixed", "restart"])
def test_quantized_equals_oracle(kv_format: str, index_kind: str | None, name: str) -> None:
    rng = np.random.default_rng(len(name))
    fam, oracle = make_family([CSA, HCA, SLIDING], 5, 8, kv_format=kv_format,
                              index_format=index_kind)  # fmt: skip
    drv = Driver(fam, oracle, seed=11, atol=2e-5, rtol=2e-5)
    for step in schedules(rng)[name]:
        drv.step([drv.seq(e[0], e[1], e[2], bool(e[3]) if len(e) > 3 else False) for e in step])


def test_quantized_differs_from_exact() -> None:
    """The quantized family is not the exact one: the same inputs give other outputs."""
    rng = np.random.default_rng(0)
    steps = schedules(rng)["chunked"][:3]
    outs = []
    for kv_format in ("exact", "fp8"):
        fam, oracle = make_family([HCA], 5, 8, kv_format=kv_format, trace=False)
        drv = Driver(fam, oracle, seed=5, atol=2e-5, rtol=2e-5)
        captured = []
        original = fam.plan

        def plan(seqs, positions, _orig=original, _cap=captured):
            ctx = _orig(seqs, positions)
            attend = ctx.attend

            def rec(*a, **k):
                out = attend(*a, **k)
                _cap.append(out)
                return out

            ctx.attend = rec
            return ctx

        fam.plan = plan
        for step in steps:
            drv.step([drv.seq(*e) for e in step])
        outs.append(torch.cat(captured))
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)
    assert torch.allclose(outs[0], outs[1], atol=0.5)


@pytest.mark.parametrize("kv_format", ["fp8", "exact"])
def test_prompt_index_scores_by_sequence_equal_oracle(kv_format, monkeypatch) -> None:
    """The family on the ops' Triton path (interpreter): prompt steps, decode rows mixed into
    them included, score the indexer's candidates per sequence
    (`index_scores_by_sequence`), and every step equals the oracle; scoring each row's own
    table instead (``KVPLAN_INDEX_BY_SEQUENCE=0``) gives the same scores."""
    import kvplan.backends.hybrid.planned_step as ps

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    calls, compared = [], []
    real = ps.index_scores_by_sequence

    def spy(q, w, keys, cu, lens, **kw):
        got = real(q, w, keys, cu, lens, **kw)
        calls.append(len(cu) - 1)
        with monkeypatch.context() as m:  # the per-row path on the same inputs
            m.setenv("KVPLAN_INDEX_BY_SEQUENCE", "0")
            table = keys.index[torch.from_numpy(np.repeat(np.arange(len(cu) - 1), np.diff(cu)))]
            col = torch.arange(table.shape[1])[None, :]
            table = torch.where(col < lens.long()[:, None], table, -1).to(torch.int32)
            want = ps.index_scores(q, w, KeySource(keys.cache, table, keys.layout))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        compared.append(bool(torch.isfinite(got).any()))
        return got

    monkeypatch.setattr(ps, "index_scores_by_sequence", spy)
    _mixed_steps_equal_oracle(kv_format, 5, 8, 5)
    assert calls and max(calls) >= 2  # steps of several sequences went through it
    assert any(compared)  # with candidates to score


@pytest.mark.parametrize("kv_format", ["fp8", "exact"])
def test_fused_split_merge_in_the_family_equals_oracle(kv_format, monkeypatch) -> None:
    """The family on the ops' Triton path (interpreter) with its sparse attention split three
    ways (16-key tiles; a 24-row window and ratio-2 entries give rows of up to ~40 keys) and
    merged by the last-arriving split program (``FUSED_COMBINE``) on the family's own merge
    counters: every step equals the oracle, no combine kernel ran, and the counters every
    call used are one buffer, left zeroed."""
    import kvplan.backends.hybrid.planned_step as ps
    import kvplan.ops.sparse_attention as sa

    class NoCombine:
        def __getitem__(self, grid):
            raise AssertionError("the two-launch combine ran")

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setenv("KVPLAN_PROMPT_RANGES", "0")  # prompt steps through the index tables too
    monkeypatch.setattr(sa, "FUSED_COMBINE", True)
    monkeypatch.setattr(sa._ks, "sparse_attention_combine_kernel", NoCombine())
    used = []

    def split3(q, sources, sinks, scale, **kw):
        if kw.get("rows") is not None:  # prompt CSA rows past top-k: no split with a row list
            return sa.sparse_attention_triton(q, sources, sinks, scale, tile_n=16, **kw)
        used.append(kw["counters"])
        return sa.sparse_attention_triton(q, sources, sinks, scale, num_splits=3, tile_n=16, **kw)

    monkeypatch.setattr(ps, "sparse_attention", split3)
    _mixed_steps_equal_oracle(kv_format, 24, 2, 3)
    assert used and all(c is used[0] for c in used)  # the family's buffer, every call
    assert used[0].dtype == torch.int32 and not used[0].any()


@pytest.mark.parametrize("kv_format", ["fp8", "exact"])
@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "index_tables"])
def test_prompt_range_path_in_the_family_equals_oracle(ranges, kv_format, monkeypatch) -> None:
    """Prompt steps on the ops' Triton path (interpreter): by default through
    ``sparse_attention_ranges`` (row blocks sharing key tiles; CSA rows whose prefix
    outgrows top-k through ``sparse_attention`` with a row list, into the same output),
    with ``KVPLAN_PROMPT_RANGES=0`` through the index tables; both equal the oracle."""
    import kvplan.backends.hybrid.planned_step as ps

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setenv("KVPLAN_PROMPT_RANGES", "1" if ranges else "0")
    seen = {"ranges": 0, "rows": 0, "index": 0}
    real_ranges, real_sparse = ps.sparse_attention_ranges, ps.sparse_attention

    def spy_ranges(q, sources, sinks, scale, **kw):
        seen["ranges"] += 1
        assert kw["blocks"] is not None
        return real_ranges(q, sources, sinks, scale, **kw)

    def spy_sparse(q, sources, sinks, scale, **kw):
        seen["rows" if kw.get("rows") is not None else "index"] += 1
        return real_sparse(q, sources, sinks, scale, **kw)

    monkeypatch.setattr(ps, "sparse_attention_ranges", spy_ranges)
    monkeypatch.setattr(ps, "sparse_attention", spy_sparse)
    _mixed_steps_equal_oracle(kv_format, 5, 8, 5, trace=False)  # an exact family traces else
    if ranges:
        assert seen["ranges"] and seen["rows"]  # both kinds of CSA prompt rows occurred
    else:
        assert not seen["ranges"] and not seen["rows"] and seen["index"]


@pytest.mark.parametrize("name", ["chunked", "restart"])
def test_prompt_range_blocks_of_four_rows_equal_oracle(name, monkeypatch) -> None:
    """The range path with blocks of 4 rows (the bf16 default; fp32 queries take 1 row a
    block, so the table is patched) over chunked prompts with history, restarts and decode
    rows: every step equals the oracle."""
    import kvplan.backends.hybrid.planned_step as ps
    from kvplan.ops import sparse_ranges as sr

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setitem(sr.RANGE_TILING_FP32, "tile_t", 4)
    widths = []
    real = ps.sparse_attention_ranges

    def spy(q, sources, sinks, scale, **kw):
        widths.extend((kw["blocks"][1] - kw["blocks"][0]).tolist())
        return real(q, sources, sinks, scale, **kw)

    monkeypatch.setattr(ps, "sparse_attention_ranges", spy)
    rng = np.random.default_rng(7)
    fam, oracle = make_family([CSA, HCA, SLIDING], 6, 4, kv_format="fp8")
    drv = Driver(fam, oracle, seed=17, atol=2e-5, rtol=2e-5)
    for step in schedules(rng)[name]:
        drv.step([drv.seq(e[0], e[1], e[2], bool(e[3]) if len(e) > 3 else False) for e in step])
    assert max(widths) == 4  # blocks of several rows shared their key tiles


def _mixed_steps_equal_oracle(
    kv_format: str, window: int, hca_ratio: int, steps: int, **family_kw
) -> None:
    """The first ``steps`` steps of the "mixed" schedule on a CSA / HCA / sliding family, each
    checked against the oracle."""
    rng = np.random.default_rng(4)
    fam, oracle = make_family([CSA, HCA, SLIDING], window, hca_ratio, kv_format=kv_format,
                              **family_kw)  # fmt: skip
    drv = Driver(fam, oracle, seed=13, atol=2e-5, rtol=2e-5)
    for step in schedules(rng)["mixed"][:steps]:
        drv.step([drv.seq(e[0], e[1], e[2], bool(e[3]) if len(e) > 3 else False) for e in step])
