"""``kvplan.ops.compress_store``: the fused pool -> RMSNorm -> RoPE -> quantize -> store kernel
(Triton interpreter on CPU) against the torch path (gather, ``pool_windows``,
``store_kv_cache``, ``index_copy_``), which is the unfused model path.

What is asserted, per case (CSA ratio 4 with overlap, HCA ratio 16; fp32 and BF16 models;
exact / fp8 / fp4 main layouts and the three index layouts):

* the state rings are bit-identical;
* the kernel's pooled entries equal the torch ones within fp32 noise (BF16 models: within one
  BF16 step, and equal for almost every element: the kernel sums in another order, which
  can move a BF16 rounding);
* the cache bytes the kernel wrote are bit-identical to ``store_kv_cache`` of its own pooled
  entries (the format math is exact), and equal the torch path's bytes on every entry whose
  pooled row is the same;
* slots ``-1`` write nothing.

With ``gate_bias`` (the raw BF16 / fp32 gate projection, a strided column view, and the fp32
position-bias table, added in the kernel): every output is bit-identical to the kernel given
the gate biased in torch, and the rings to the torch path's. The kernel also compiles for
sm_90 at the model's widths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.backends.hybrid.storage import index_format, main_format
from kvplan.formats import alloc_kv_cache, split_kv_cache
from kvplan.ops import _compress_store_kernels as kernels
from kvplan.ops.compress_store import (
    GateBias,
    PoolWeights,
    biased_gate,
    cache_rows,
    compress_store_torch,
    compress_store_triton,
    fused_supported,
)
from kvplan.ops.store import store_kv_cache
from kvplan.plan.compressor_state import expand_window_index, plan_compressor_state
from kvplan.plan.sequence import SequenceMetadata

BLOCK, NUM_BLOCKS, SLOTS = 8, 4, 3
LAYOUTS = [
    ("main", "exact", None),
    ("main", "fp8", None),
    ("main", "fp4", None),
    ("index", "fp8", "mxfp8"),
    ("index", "fp8", "fp8_fp32sf"),
    ("index", "fp8", "fp4"),
]


def _seq(q_start: int, seqlen_q: int, state_id: int) -> SequenceMetadata:
    sk = q_start + seqlen_q
    return SequenceMetadata(seqlen_q=seqlen_q, seqlen_k=sk, block_table=(1,), state_id=state_id,
                            token_ids=tuple(range(sk)))  # fmt: skip


def _case(ratio, overlap, dtype, width, decode, seed):
    """Random step inputs: ring contents, the window index of a planned step, slots."""
    gen = torch.Generator().manual_seed(seed)
    if decode:  # each row closes its window
        seqs = [_seq(ratio - 1, 1, 0), _seq(3 * ratio - 1, 1, 2), _seq(2 * ratio - 1, 1, 1)]
    else:  # a chunk straddling windows, a first chunk, a decode row
        seqs = [_seq(ratio + 2, 2 * ratio + 1, 1), _seq(0, ratio + 1, 0), _seq(ratio - 1, 1, 2)]
    plan = plan_compressor_state(seqs, ratio, overlap)
    big_r = plan.state_rows
    ring_rows = SLOTS * big_r
    index = expand_window_index(torch.from_numpy(plan.window_facts), big_r, ring_rows)
    num_rows, kc = sum(s.seqlen_q for s in seqs), (2 if overlap else 1) * width
    kv = torch.randn(num_rows, kc, generator=gen).to(dtype)
    gate = torch.randn(num_rows, kc, generator=gen) * 2
    ring = torch.randn(ring_rows + 1, kc, generator=gen).to(dtype).float()
    gring = torch.randn(ring_rows + 1, kc, generator=gen) * 2
    store = plan.slot_mapping_store_state
    store_rows = torch.from_numpy(np.where(store >= 0, store, ring_rows).astype(np.int64))
    num_entries = plan.num_entries
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:num_entries].to(torch.int32)
    slots[0] = -1  # one entry stores nothing
    weights = PoolWeights(1 + 0.2 * torch.randn(width, generator=gen), 1e-6,
                          torch.rand(width // 4, generator=gen), 1.25)  # fmt: skip
    positions = torch.from_numpy(plan.positions)
    return kv, gate, ring, gring, index.long(), positions, slots, store_rows, weights


def _records(cache: torch.Tensor, layout) -> torch.Tensor:
    """uint8 ``[num_slots, bytes_per_token]``: each slot's value bytes then scale bytes."""
    values, scales = split_kv_cache(cache, layout)
    parts = [values] if scales is None else [values, scales]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(NUM_BLOCKS * BLOCK, -1)
                      for p in parts], dim=1)  # fmt: skip


def _layout(kind, kv_format, index_kind, width, dtype):
    if kind == "main":
        return main_format(kv_format, width, dtype)
    return index_format(kv_format, index_kind, width, dtype)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("decode", [False, True])
def test_fused_equals_torch_path(ratio, overlap, dtype, layout_case, decode):
    width = 32
    layout = _layout(*layout_case, width, dtype)
    kv, gate, ring, gring, index, pos, slots, store_rows, w = _case(
        ratio, overlap, dtype, width, decode, seed=ratio + 7 * decode
    )
    assert fused_supported(kv, layout, w)
    cache_ref = alloc_kv_cache(NUM_BLOCKS, BLOCK, layout).random_(0, 256)
    cache_got = cache_ref.clone()
    ring_ref, gring_ref, ring_got, gring_got = ring.clone(), gring.clone(), ring.clone(), gring
    args = (index, pos, slots, store_rows, w)
    want = compress_store_torch(kv, gate, ring_ref, gring_ref, *args, cache_ref, layout,
                                ratio=ratio, overlap=overlap)  # fmt: skip
    got = torch.full((index.shape[0], width), float("nan"))
    before = cache_got.clone()
    trash = ring_got[-1].clone(), gring_got[-1].clone()
    compress_store_triton(kv, gate, ring_got, gring_got, *args, cache_got, layout, ratio=ratio,
                          overlap=overlap, state_in_launch=decode, pooled_out=got)  # fmt: skip
    # the kept rows as the torch path writes them; the rings' last row is the trash row,
    # which the torch path writes (every row not kept) and the kernel leaves alone
    assert torch.equal(ring_got[:-1], ring_ref[:-1]) and torch.equal(gring_got[:-1], gring_ref[:-1])
    assert torch.equal(ring_got[-1], trash[0]) and torch.equal(gring_got[-1], trash[1])
    if not decode:  # a prompt keeps a few rows of each sequence: the case has rows not kept
        assert bool((store_rows == ring.shape[0] - 1).any())
    # pooled entries: fp32 noise, or one BF16 step on a few elements
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=2**-7)
        assert (got == want.float()).float().mean() >= 0.95
    # the stored bytes are store_kv_cache's bytes of the kernel's own entries
    cache_own = before.clone()
    store_kv_cache(cache_rows(got.to(dtype), layout), cache_own, slots, layout=layout, check=False)
    assert torch.equal(cache_got, cache_own)
    # and the torch path's bytes wherever the store's input row is the same (the BF16
    # rounding of the entry; fp32 rows in an exact layout differ in their last bits)
    stored_got, stored_want = cache_rows(got.to(dtype), layout), cache_rows(want, layout)
    same = (stored_got == stored_want).all(dim=1) & (slots >= 0)
    exact_fp32 = layout_case[1] == "exact" and dtype == torch.float32
    assert exact_fp32 or int(same.sum()) >= int((slots >= 0).sum()) - 1
    rows = slots[same].long()
    assert torch.equal(_records(cache_got, layout)[rows], _records(cache_ref, layout)[rows])
    # (cache_own also shows that slot -1 wrote nothing: store_kv_cache skips it)
    assert int(slots[0]) == -1


def test_unsupported_shapes_are_refused():
    w = PoolWeights(torch.ones(24), 1e-6, torch.rand(4), 1.0)
    kv = torch.zeros(2, 24)
    assert not fused_supported(kv, main_format("fp8", 24, torch.float32), w)
    assert not fused_supported(kv.half(), main_format("exact", 24, torch.float16), w)
    w32 = PoolWeights(torch.ones(32), 1e-6, torch.rand(4), 1.0)
    assert fused_supported(torch.zeros(2, 32), main_format("fp4", 32, torch.float32), w32)
    with pytest.raises(ValueError, match="window_index"):
        cache = alloc_kv_cache(1, 4, main_format("fp8", 32, torch.float32))
        compress_store_triton(
            torch.zeros(1, 32), torch.zeros(1, 32), torch.zeros(5, 32), torch.zeros(5, 32),
            torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long), w32, cache,
            main_format("fp8", 32, torch.float32), ratio=4, overlap=False,
        )  # fmt: skip


def _check_gate_bias(ratio, overlap, dtype, decode, width, layout, dev):
    """The raw gate (model dtype, a column view of a wider projection) and the bias table in
    the kernel give the same bits as the gate biased in torch, in the cache, the rings and
    the pooled entries; the rings also equal the torch path's (bias added in torch)."""
    case = _case(ratio, overlap, dtype, width, decode, seed=11 + ratio + decode)
    kv, _, ring, gring, index, pos, slots, store_rows = (t.to(dev) for t in case[:-1])
    w = PoolWeights(*(x.to(dev) if isinstance(x, torch.Tensor) else x for x in case[-1]))
    gen = torch.Generator().manual_seed(5 + ratio + 2 * decode)
    num_rows, kc = kv.shape
    fused_out = torch.randn(num_rows, 3 * kc, generator=gen).mul(2).to(dtype)  # [kv | gate | q]
    raw_gate = fused_out.to(dev)[:, kc : 2 * kc]  # row stride 3 * kc, unit column stride
    table = (torch.randn(ratio, kc, generator=gen) * 0.5).to(dev)
    # any int64 positions (the kernel only indexes the table): large, one negative, strided
    step_pos = torch.randint(-2 * ratio, 10_000, (2 * num_rows,), generator=gen)[::2]
    step_pos[0] = -3
    bias = GateBias(table, step_pos.to(dev))
    gate = raw_gate.float() + table[bias.positions % ratio]  # what the model computed in torch
    assert torch.equal(biased_gate(raw_gate, bias), gate)
    cache0 = alloc_kv_cache(NUM_BLOCKS, BLOCK, layout, device=dev).random_(0, 256)
    args = (index, pos, slots, store_rows, w)
    runs = []
    for g, b in ((gate, None), (raw_gate, bias)):
        rings, cache = (ring.clone(), gring.clone()), cache0.clone()
        pooled = torch.full((index.shape[0], width), float("nan"), device=dev)
        compress_store_triton(kv, g, *rings, *args, cache, layout, ratio=ratio, overlap=overlap,
                              state_in_launch=decode, pooled_out=pooled, gate_bias=b)  # fmt: skip
        runs.append((*rings, cache, pooled))
    # the rings' last row is the trash row: every step row not kept writes it, in no set
    # order, so its contents are undefined and left out
    for i, (want, got) in enumerate(zip(*runs, strict=True)):
        if i < 2:
            want, got = want[:-1], got[:-1]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    ring_ref, gring_ref = ring.clone(), gring.clone()
    entries = compress_store_torch(kv, raw_gate, ring_ref, gring_ref, *args, cache0.clone(),
                                   layout, ratio=ratio, overlap=overlap, gate_bias=bias)  # fmt: skip
    assert torch.equal(runs[1][0][:-1], ring_ref[:-1])
    assert torch.equal(runs[1][1][:-1], gring_ref[:-1])
    atol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(runs[1][3], entries.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
def test_in_kernel_gate_bias_is_bit_identical(ratio, overlap, dtype, decode):
    layout = main_format("exact", 32, dtype)
    _check_gate_bias(ratio, overlap, dtype, decode, 32, layout, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,overlap,width", [(4, True, 512), (4, True, 128), (128, False, 512)])
@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
@pytest.mark.parametrize("decode", [False, True])
def test_in_kernel_gate_bias_is_bit_identical_on_gpu(ratio, overlap, width, kv_format, decode):
    """Real widths, compiled code (libdevice, hardware fp8): the same bit identity."""
    layout = main_format(kv_format, width, torch.bfloat16)
    _check_gate_bias(ratio, overlap, torch.bfloat16, decode, width, layout, torch.device("cuda"))


def test_gate_bias_is_validated():
    w = PoolWeights(torch.ones(32), 1e-6, torch.rand(4), 1.0)
    layout = main_format("fp8", 32, torch.float32)
    cache = alloc_kv_cache(1, 4, layout)

    def call(gate, gate_bias):
        compress_store_triton(
            torch.zeros(2, 32), gate, torch.zeros(5, 32), torch.zeros(5, 32),
            torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.full((1,), -1, dtype=torch.int32), torch.full((2,), 4), w, cache, layout,
            ratio=4, overlap=False, gate_bias=gate_bias,
        )  # fmt: skip

    table, pos = torch.zeros(4, 32), torch.arange(2)
    with pytest.raises(TypeError, match="gate must have dtype torch.float32, got torch.bfloat16"):
        call(torch.zeros(2, 32, dtype=torch.bfloat16), None)  # a raw gate needs its bias
    with pytest.raises(TypeError, match="gate_bias must be a GateBias, got tuple"):
        call(torch.zeros(2, 32), (table, pos))
    with pytest.raises(
        ValueError, match=r"gate_bias.table must have shape \(4, 32\), got \(2, 32\)"
    ):
        call(torch.zeros(2, 32), GateBias(torch.zeros(2, 32), pos))
    with pytest.raises(TypeError, match="gate_bias.table must have dtype torch.float32"):
        call(torch.zeros(2, 32), GateBias(table.bfloat16(), pos))
    with pytest.raises(TypeError, match="gate_bias.positions must have dtype"):
        call(torch.zeros(2, 32), GateBias(table, pos.float()))
    with pytest.raises(ValueError, match=r"gate_bias.positions must have shape \(2,\), got \(3,\)"):
        call(torch.zeros(2, 32), GateBias(table, torch.arange(3)))
    call(torch.zeros(2, 32, dtype=torch.bfloat16), GateBias(table, pos))  # accepted
    call(torch.zeros(2, 32), GateBias(table.t().contiguous().t(), torch.arange(4)[::2]))


_SM90_CASES = {  # the model's series: CSA main (FP8, UE8M0 per 32), HCA main (FP4), index
    "csa": dict(C=512, R=8, RATIO=4, OVERLAP=True, NOPE_PAIRS=224, GS=32, G=16, FP4=False,
                QMAX=448.0, SF=0, SB=1),
    "hca": dict(C=512, R=128, RATIO=128, OVERLAP=False, NOPE_PAIRS=224, GS=16, G=32, FP4=True,
                QMAX=6.0, SF=1, SB=1),
    "indexer": dict(C=128, R=8, RATIO=4, OVERLAP=True, NOPE_PAIRS=32, GS=128, G=1, FP4=False,
                    QMAX=448.0, SF=2, SB=4),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_SM90_CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_compiles_for_sm90(case, bias):
    sig = {"kv_ptr": "*bf16", "gate_ptr": "*bf16" if bias else "*fp32", "kv_ring_ptr": "*fp32",
           "gate_ring_ptr": "*fp32", "index_ptr": "*i64", "pos_ptr": "*i64", "slot_ptr": "*i32",
           "store_rows_ptr": "*i64", "norm_ptr": "*fp32", "inv_freq_ptr": "*fp32",
           "cache_ptr": "*u8", "pooled_ptr": "*fp32", "bias_ptr": "*fp32",
           "step_pos_ptr": "*i64", "eps": "fp32", "rope_scale": "fp32"}  # fmt: skip
    cfg = _SM90_CASES[case]
    compile_sm90(kernels.compress_store_kernel, "*i32", sig, BLOCK_SIZE=64, ROW_TILE=8, BF16=True,
                 FMT=kernels.FMT_QUANT, HW=True, FAST_DIV=cfg["SF"] == 2, EXACT=True,
                 WRITE_POOLED=False, BIAS=bias, **cfg)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,overlap,width", [(4, True, 512), (4, True, 128), (128, False, 512)])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_fused_equals_torch_path_on_gpu(ratio, overlap, width, layout_case):
    """Real widths on the GPU (hardware fp8 conversion, libdevice math): bytes equal
    ``store_kv_cache`` of the kernel's own entries; entries within one BF16 step of torch's."""
    dtype, dev = torch.bfloat16, torch.device("cuda")
    layout = _layout(*layout_case, width, dtype)
    case = _case(ratio, overlap, dtype, width, True, seed=3)
    kv, gate, ring, gring, index, pos, slots, store_rows, w = (
        PoolWeights(*(x.to(dev) if isinstance(x, torch.Tensor) else x for x in c))
        if isinstance(c, PoolWeights)
        else c.to(dev)
        for c in case
    )
    cache_ref = alloc_kv_cache(NUM_BLOCKS, BLOCK, layout, device=dev).random_(0, 256)
    cache_got = cache_ref.clone()
    want = compress_store_torch(kv, gate, ring.clone(), gring.clone(), index, pos, slots,
                                store_rows, w, cache_ref, layout, ratio=ratio, overlap=overlap)  # fmt: skip
    got = torch.zeros(index.shape[0], width, device=dev)
    before = cache_got.clone()
    compress_store_triton(kv, gate, ring, gring, index, pos, slots, store_rows, w, cache_got,
                          layout, ratio=ratio, overlap=overlap, state_in_launch=True,
                          pooled_out=got)  # fmt: skip
    torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=2**-7)
    assert (got == want.float()).float().mean() >= 0.95
    store_kv_cache(cache_rows(got.to(dtype), layout), before, slots, layout=layout, check=False)
    assert torch.equal(cache_got, before)
