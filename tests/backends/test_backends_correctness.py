"""Every backend's attention output equals an independent dense reference (fp32 on CPU).

Random batches cover: mixed prefill + decode, chunked prefill over cached history, GQA,
sliding windows (per backend object and per layer through VSWA pools), speculative rows with
reserved blocks past them, beam width > 1, cross attention, and a context-only batch without
a cache manager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends_testlib import (
    SeqSpec,
    assert_close,
    fill_metadata,
    fp8_reference,
    make_scenario,
    random_specs,
    reference_attention,
    row_blocks,
)

from kvplan.backends import get_backend

BACKENDS = ["vanilla", "ragged", "block_offsets"]


def run_layers(name, sc, *, window_from_backend=True, **md_kwargs):
    backend_cls = get_backend(name)
    if name != "vanilla":
        md_kwargs.setdefault("check_kernel_inputs", True)
    if name == "ragged":
        md_kwargs.setdefault("check_page_table", True)
    md = backend_cls.Metadata(
        max_num_requests=16,
        max_num_tokens=256,
        max_num_sequences=32,
        kv_cache_manager=sc.manager,
        kv_cache=sc.kv,
        layer_windows=sc.layer_windows,
        **md_kwargs,
    )
    fill_metadata(md, sc)
    md.prepare()
    outs = []
    for layer, window in enumerate(sc.layer_windows):
        layer_window = window if window_from_backend else None
        attn = backend_cls(
            layer, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=layer_window
        )
        outs.append(attn.forward(sc.q, sc.k[layer], sc.v[layer], md))
    return md, outs


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_reference(name, seed):
    specs = random_specs(seed, num_ctx=3, num_gen=4)
    sc = make_scenario(seed, specs, layer_windows=(None, 6), num_heads=4, num_kv_heads=2)
    _, outs = run_layers(name, sc, window_from_backend=seed % 2 == 0)
    for layer, window in enumerate(sc.layer_windows):
        assert_close(outs[layer], reference_attention(sc, layer, window), atol=1e-5)


SPEC_VARIANTS = [
    ("vanilla", {}),
    ("ragged", {}),
    ("ragged", {"use_full_generation_page_table": True}),
    ("block_offsets", {}),
    ("block_offsets", {"num_extra_kv_tokens": 2, "enable_block_id_tables": True}),
    ("block_offsets", {"is_spec_decoding_enabled": True, "enable_block_id_tables": True}),
]


@pytest.mark.parametrize(("name", "md_kwargs"), SPEC_VARIANTS)
def test_speculative_rows_with_reserved_blocks(name, md_kwargs):
    """Reserved slots past each row hold garbage; attention must stop at the logical length."""
    specs = random_specs(5, num_ctx=2, num_gen=5, spec_rows=True)
    for s in specs:
        s.reserve_extra = max(s.reserve_extra, 2)
    assert any(s.q_len > 1 for s in specs) and any(s.reserve_extra > 4 for s in specs)
    sc = make_scenario(5, specs, num_heads=8, num_kv_heads=2)
    md, outs = run_layers(name, sc, **md_kwargs)
    assert_close(outs[0], reference_attention(sc, 0, None), atol=1e-5)
    if md_kwargs.get("use_full_generation_page_table"):
        nc = md.num_contexts
        assert (md.num_blocks_np[nc:] > md.logical_num_blocks_np[nc:]).any()
        assert (md.num_blocks_np[:nc] == md.logical_num_blocks_np[:nc]).all()
    if name == "block_offsets":
        # every column of the batch's rows is written (a speculative sub-step on the device
        # may read reserved columns): the manager's full rows, block 0 past the allocated ones
        assert md.copied_width == sc.manager.max_blocks_per_seq
        for row in range(md.num_seqs):
            want = row_blocks(sc, row, 0, sc.manager.max_blocks_per_seq)
            want += [0] * (sc.manager.max_blocks_per_seq - len(want))
            assert md.kv_cache_block_offsets[0, row, 0].tolist() == want
            assert md.kv_cache_block_offsets[0, row, 1].tolist() == want
        assert md.block_id_tables_valid == bool(md_kwargs.get("enable_block_id_tables"))


@pytest.mark.parametrize("name", BACKENDS)
def test_beam_width_two(name):
    specs = random_specs(7, num_ctx=2, num_gen=3)
    sc = make_scenario(7, specs, beam_width=2, layer_windows=(None, 5))
    assert len(sc.seq_lens) == 2 + 3 * 2
    _, outs = run_layers(name, sc)
    for layer, window in enumerate(sc.layer_windows):
        assert_close(outs[layer], reference_attention(sc, layer, window), atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_cross_attention_with_beams(name):
    specs = [SeqSpec(9, 5, True), SeqSpec(6, 3, True), SeqSpec(13, 1, False), SeqSpec(4, 1, False)]
    sc = make_scenario(11, specs, beam_width=3, cross=True)
    md, outs = run_layers(name, sc)
    assert md.is_cross
    assert_close(outs[0], reference_attention(sc, 0, None), atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_mha_single_kv_group_and_long_history(name):
    specs = [SeqSpec(37, 9, True), SeqSpec(50, 1, False), SeqSpec(3, 1, False)]
    sc = make_scenario(3, specs, num_heads=2, num_kv_heads=2, max_blocks_per_seq=24)
    _, outs = run_layers(name, sc)
    assert_close(outs[0], reference_attention(sc, 0, None), atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_context_only_without_cache(name):
    torch.manual_seed(0)
    backend_cls = get_backend(name)
    md = backend_cls.Metadata(max_num_requests=4, max_num_tokens=64)
    md.num_contexts = 3
    md.seq_lens = [5, 1, 7]
    md.prepare()
    q = torch.randn(13, 4, 16)
    k = torch.randn(13, 2, 16)
    v = torch.randn(13, 2, 16)
    out = backend_cls(0, 4, 2, 16, sliding_window=4).forward(q, k, v, md)
    # reference: one sequence at a time with the test's own mask
    start = 0
    for n in (5, 1, 7):
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        for i in range(n):
            lo = max(0, i - 3)
            for h in range(4):
                s = (ks[lo : i + 1, h // 2] @ qs[i, h]) / 4.0
                want = torch.softmax(s.double(), 0) @ vs[lo : i + 1, h // 2].double()
                torch.testing.assert_close(out[start + i, h].double(), want, atol=1e-5, rtol=0)
        start += n


def _check_fp8_outputs(sc, outs):
    for layer, window in enumerate(sc.layer_windows):
        want = fp8_reference(sc, layer, None if sc.cross else window)
        err = (outs[layer].double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err


@pytest.mark.parametrize("name", BACKENDS)
def test_fp8_cache_attends_over_the_dequantized_values(name):
    specs = [SeqSpec(6, 5, True), SeqSpec(11, 1, False), SeqSpec(4, 1, False)]
    sc = make_scenario(17, specs, head_dim=32, kv_format="fp8", layer_windows=(None, 5))
    _, outs = run_layers(name, sc)
    _check_fp8_outputs(sc, outs)


@pytest.mark.parametrize("name", ["ragged", "block_offsets"])
@pytest.mark.parametrize(("beam_width", "cross", "kv_format"),
                         [(1, False, "fp8"), (2, False, "fp4"), (2, True, "fp8")])  # fmt: skip
def test_quantized_paged_backends_read_pages_in_place(name, beam_width, cross, kv_format,
                                                      monkeypatch):  # fmt: skip
    """fp8 / fp4 forwards of the page-table backends hand the raw caches to the kernels: no
    page is dequantized into a buffer (no load_paged_kv_cache, no read_blocks); the outputs
    still match the reference over the dequantized values."""
    import kvplan.ops.load as load
    from kvplan.cache.kv_tensors import KVCacheTensors

    specs = [SeqSpec(6, 5, True), SeqSpec(13, 1, False), SeqSpec(4, 2, False)]
    if cross:
        specs = [SeqSpec(9, 3, True), SeqSpec(6, 1, False)]
    windows = (None,) if cross else (None, 5)
    sc = make_scenario(29, specs, beam_width=beam_width, cross=cross, head_dim=32,
                       kv_format=kv_format, layer_windows=windows)  # fmt: skip

    def dequantized_copy(*args, **kwargs):
        raise AssertionError("a quantized forward dequantized pages into a buffer")

    monkeypatch.setattr(load, "load_paged_kv_cache", dequantized_copy)
    monkeypatch.setattr(KVCacheTensors, "read_blocks", dequantized_copy)
    _, outs = run_layers(name, sc)
    monkeypatch.undo()
    _check_fp8_outputs(sc, outs)


@pytest.mark.parametrize("seed", range(100, 106))
def test_random_sweep_all_backends(seed):
    """Random geometry (block size, GQA ratio, window, beams, speculative rows) per seed."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 8]))
    num_kv_heads = int(rng.choice([1, 2]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 4]))
    beam = int(rng.choice([1, 2]))
    window = None if rng.random() < 0.4 else int(rng.integers(1, 12))
    specs = random_specs(seed, num_ctx=int(rng.integers(0, 3)), num_gen=int(rng.integers(1, 4)),
                         max_cached=30, spec_rows=bool(rng.random() < 0.5))  # fmt: skip
    sc = make_scenario(
        seed, specs, beam_width=beam, num_heads=num_heads, num_kv_heads=num_kv_heads,
        block_size=block_size, max_blocks_per_seq=-(-48 // block_size), num_blocks=400,
        layer_windows=(window,),
    )  # fmt: skip
    want = reference_attention(sc, 0, window)
    for name in BACKENDS:
        _, outs = run_layers(name, sc)
        assert_close(outs[0], want, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_cross_attention_without_cache(name):
    """Encoder-decoder step without a cache: every query sees all of its row's K/V rows."""
    torch.manual_seed(1)
    backend_cls = get_backend(name)
    md = backend_cls.Metadata(max_num_requests=4, max_num_tokens=64)
    md.num_contexts = 2
    md.seq_lens = [3, 2]
    md.seq_lens_kv = [5, 7]
    md.prepare()
    assert md.is_cross
    q, k, v = torch.randn(5, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    out = backend_cls(0, 4, 2, 16, sliding_window=2).forward(q, k, v, md)  # window ignored
    rows = [(0, 3, 0, 5), (3, 5, 5, 12)]
    for q0, q1, k0, k1 in rows:
        for t in range(q0, q1):
            for h in range(4):
                s = (k[k0:k1, h // 2] @ q[t, h]) / 4.0
                want = torch.softmax(s.double(), 0) @ v[k0:k1, h // 2].double()
                torch.testing.assert_close(out[t, h].double(), want, atol=1e-5, rtol=0)
