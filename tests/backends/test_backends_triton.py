"""The paged backends through the Triton kernels: interpreter on CPU (tiny), bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
from backends_testlib import (
    SeqSpec,
    fill_metadata,
    fp8_reference,
    make_scenario,
    random_specs,
    reference_attention,
    subset,
)

import kvplan.ops.paged_attention as pa
from kvplan.backends import get_backend
from kvplan.ops._dispatch import triton_interpreting

PAGED = ["ragged", "block_offsets"]


def run(name, sc, layer=0, window=None, **kw):
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=64, max_num_tokens=2048, max_num_sequences=128,
        kv_cache_manager=sc.manager, kv_cache=sc.kv, device=sc.q.device, **kw,
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    attn = cls(layer, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window)
    return attn.forward(sc.q, sc.k[layer], sc.v[layer], md)


TINY = [
    ([SeqSpec(5, 3, True), SeqSpec(6, 1, False), SeqSpec(3, 2, False, 3)], ["prefill"] * 2),
    ([SeqSpec(9, 1, False), SeqSpec(2, 1, False)], ["decode"]),
]


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize(("specs", "kernels"), TINY)
def test_triton_interpreter_tiny(name, specs, kernels, monkeypatch):
    """Prefill, speculative and decode rows through the Triton kernels (fp32, interpreter)."""
    if not triton_interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set on CPU-only machines)")
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    calls = []
    for fn in ("paged_attention_decode_triton", "paged_attention_prefill_triton"):
        orig = getattr(pa, fn)
        monkeypatch.setattr(pa, fn, lambda *a, _o=orig, _n=fn, **k: calls.append(_n) or _o(*a, **k))
    sc = make_scenario(8, specs, num_heads=2, num_kv_heads=1, head_dim=16, max_blocks_per_seq=4)
    out = run(name, sc, window=5)
    torch.testing.assert_close(out.double(), reference_attention(sc, 0, 5), atol=1e-5, rtol=0)
    assert calls == [f"paged_attention_{k}_triton" for k in kernels]


@pytest.mark.parametrize("name", PAGED)
def test_metadata_reused_for_a_second_batch_keeps_buffers(name):
    """CPU counterpart of the CUDA-graph test: same object, same addresses, new batch."""
    specs = [SeqSpec(c, 1, False) for c in (35, 20, 17, 51, 6, 9, 30, 7)]
    sc = make_scenario(9, specs, max_blocks_per_seq=16)
    first, second = subset(sc, [0, 1, 2, 3]), subset(sc, [4, 5, 6, 7])
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=4, max_num_tokens=4, kv_cache_manager=sc.manager, kv_cache=sc.kv,
        is_cuda_graph=True, check_kernel_inputs=True,
    )  # fmt: skip
    attn = cls(0, 4, 2, 16)
    fill_metadata(md, first)
    md.prepare()
    view = md.paged_view(0).generation
    ptrs = (view.page_ids.data_ptr(), view.page_start.data_ptr(), view.kv_lens.data_ptr())
    slot_ptr = md.slot_mapping(0).data_ptr()
    out = attn.forward(first.q, first.k[0], first.v[0], md)
    torch.testing.assert_close(out.double(), reference_attention(first, 0, None), atol=1e-5, rtol=0)
    fill_metadata(md, second)
    md.prepare()
    view = md.paged_view(0).generation
    assert (view.page_ids.data_ptr(), view.page_start.data_ptr(), view.kv_lens.data_ptr()) == ptrs
    assert md.slot_mapping(0).data_ptr() == slot_ptr
    out = attn.forward(second.q, second.k[0], second.v[0], md)
    torch.testing.assert_close(
        out.double(), reference_attention(second, 0, None), atol=1e-5, rtol=0
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().double().cpu()
    return float((a - expected).abs().max() / expected.abs().max())


GPU_CASES = [
    # (specs seed, beam_width, cross, layer_windows, metadata kwargs)
    (0, 1, False, (None, 96), {}),
    (1, 2, False, (None,), {}),
    (2, 3, True, (None,), {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vanilla", *PAGED])
@pytest.mark.parametrize(("seed", "beam", "cross", "windows", "kw"), GPU_CASES)
def test_gpu_bf16_matches_reference(name, seed, beam, cross, windows, kw):
    if cross:
        specs = [SeqSpec(300, 40, True), SeqSpec(77, 1, False), SeqSpec(513, 1, False)]
    else:
        specs = random_specs(seed, num_ctx=3, num_gen=12, max_cached=700, spec_rows=seed == 0)
    sc = make_scenario(
        seed, specs, beam_width=beam, cross=cross, layer_windows=windows, num_heads=16,
        num_kv_heads=4, head_dim=128, block_size=16, num_blocks=2048, max_blocks_per_seq=64,
        kv_format="bf16", dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    for layer, window in enumerate(windows):
        out = run(name, sc, layer, window, **kw)
        torch.cuda.synchronize()
        assert rel_err(out, reference_attention(sc, layer, window)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "kw"),
    [("ragged", {"use_full_generation_page_table": True}),
     ("block_offsets", {"num_extra_kv_tokens": 2, "enable_block_id_tables": True})],
)  # fmt: skip
def test_gpu_bf16_speculative_variants(name, kw):
    specs = random_specs(4, num_ctx=2, num_gen=20, max_cached=500, spec_rows=True)
    for s in specs:
        s.reserve_extra = max(s.reserve_extra, 2)
    sc = make_scenario(
        4, specs, num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=2048,
        max_blocks_per_seq=64, kv_format="bf16", dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    out = run(name, sc, **kw)
    torch.cuda.synchronize()
    assert rel_err(out, reference_attention(sc, 0, None)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "kw"),
    [("ragged", {}), ("block_offsets", {}), ("block_offsets", {"enable_block_id_tables": True})],
)
def test_gpu_cuda_graph_replays_with_metadata_written_in_place(name, kw):
    """Capture one decode step, then replay it for a different batch of the same size:
    prepare() must write every buffer the graph reads in place."""
    specs = [SeqSpec(c, 1, False) for c in (35, 200, 17, 513, 64, 99, 300, 7)]
    sc = make_scenario(
        9, specs, num_heads=16, num_kv_heads=4, head_dim=128, block_size=16, num_blocks=1024,
        max_blocks_per_seq=64, kv_format="bf16", dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    first, second = subset(sc, [0, 1, 2, 3]), subset(sc, [4, 5, 6, 7])
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=4, max_num_tokens=4, kv_cache_manager=sc.manager, kv_cache=sc.kv,
        device="cuda", is_cuda_graph=True, **kw,
    )  # fmt: skip
    attn = cls(0, 16, 4, 128)
    q, k, v = first.q.clone(), first.k[0].clone(), first.v[0].clone()
    out = torch.empty_like(q)
    fill_metadata(md, first)
    md.prepare()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernel compilation) outside the capture
        attn.forward(q, k, v, md, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.forward(q, k, v, md, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference_attention(first, 0, None)) < 1e-2
    fill_metadata(md, second)
    md.prepare()
    q.copy_(second.q)
    k.copy_(second.k[0])
    v.copy_(second.v[0])
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference_attention(second, 0, None)) < 1e-2


@pytest.mark.gpu
def test_gpu_block_id_tables_are_skipped_while_capturing():
    sc = make_scenario(
        3, [SeqSpec(40, 1, False), SeqSpec(9, 1, False)], head_dim=64, block_size=16,
        kv_format="bf16", dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    cls = get_backend("block_offsets")
    md = cls.Metadata(
        max_num_requests=2, max_num_tokens=2, kv_cache_manager=sc.manager, kv_cache=sc.kv,
        device="cuda", enable_block_id_tables=True,
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    assert md.block_id_tables_valid
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        md.prepare_block_id_tables()
    assert not md.block_id_tables_valid, "request-specific fills must not be captured"


@pytest.mark.gpu
@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize(("beam", "cross", "kv_format"), [(1, False, "fp8"), (2, True, "fp8"),
                                                          (1, False, "fp4")])  # fmt: skip
def test_gpu_quantized_pages_read_in_place_without_a_sync(name, beam, cross, kv_format):
    """fp8 / fp4 cache on the GPU: the forward (fused quantize + store, paged kernel reading
    the pages in place) runs with CUDA sync debugging set to error, and matches the reference
    over the read-back values. CPU counterpart:
    test_backends_correctness.py::test_quantized_paged_backends_read_pages_in_place."""
    if cross:
        specs = [SeqSpec(300, 40, True), SeqSpec(77, 1, False), SeqSpec(513, 1, False)]
    else:
        specs = random_specs(5, num_ctx=3, num_gen=12, max_cached=700)
    sc = make_scenario(
        5, specs, beam_width=beam, cross=cross, num_heads=16, num_kv_heads=4, head_dim=128,
        block_size=16, num_blocks=2048, max_blocks_per_seq=64, kv_format=kv_format,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    cls = get_backend(name)
    md = cls.Metadata(
        max_num_requests=64, max_num_tokens=2048, max_num_sequences=128,
        kv_cache_manager=sc.manager, kv_cache=sc.kv, device="cuda",
    )  # fmt: skip
    fill_metadata(md, sc)
    md.prepare()
    attn = cls(0, sc.num_heads, sc.num_kv_heads, sc.head_dim)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attn.forward(sc.q, sc.k[0], sc.v[0], md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert rel_err(out, fp8_reference(sc, 0, None)) < 2e-2
