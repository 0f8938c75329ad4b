"""Paged attention: Triton (interpreter on CPU, compiled on GPU) == torch path == reference.

Every case builds a random, shuffled page table (block 0 reserved as padding), fills every
cache slot that no visible key occupies with NaN (so a kernel that reads a reserved page, a
slot past the logical length or a page before the sliding window poisons its output), and
compares against the per-query float64 reference.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import pytest
import torch

import kvplan.ops._paged_attention_kernels as pak
from kvplan.ops._paged_kv_tiles import kv_geometry
from kvplan.ops.paged_attention import (
    default_num_splits,
    paged_attention_decode,
    paged_attention_decode_torch,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_torch,
    paged_attention_prefill_triton,
    paged_attention_ref,
)


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    page_ids: torch.Tensor  # int32 flat
    page_start: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    kv_lens: torch.Tensor  # int32 [B]
    scale: float
    window: int | None

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.page_ids, self.page_start)

    def ref(self, decode: bool) -> torch.Tensor:
        return paged_attention_ref(
            *self.args(), None if decode else self.cu_seqlens_q, self.kv_lens,
            scale=self.scale, sliding_window=self.window,
        )  # fmt: skip


def make_case(
    seed: int,
    kv_lens: list[int],
    q_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    window: int | None = None,
    layout: str = "ragged",
    reserve: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    pad_block_stride: int = 0,
) -> Case:
    """Random case. ``reserve`` extra pages per sequence are mapped past the logical length."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(kv_lens)
    pages = [-(-n // block_size) + reserve for n in kv_lens]
    num_blocks = sum(pages) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 never used
    tables = [perm[sum(pages[:b]) : sum(pages[: b + 1])] for b in range(batch)]
    if layout == "ragged":
        page_ids = [i for t in tables for i in t]
        page_start = [sum(pages[:b]) for b in range(batch)]
    else:  # block offsets: fixed-width rows padded with block 0
        width = max(pages) + 2
        page_ids = [i for t in tables for i in t + [0] * (width - len(t))]
        page_start = [b * width for b in range(batch)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv = torch.full(
        (2, num_blocks, block_size + pad_block_stride, num_kv_heads, head_dim), math.nan
    )
    for b in range(batch):
        q_len, kv_len = q_lens[b], kv_lens[b]
        first = max(0, kv_len - q_len - (window - 1)) if window else 0  # earliest visible key
        for j in range(first, kv_len):
            blk, row = tables[b][j // block_size], j % block_size
            kv[:, blk, row] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(dtype)[:, :, :block_size]  # padded block stride -> non-contiguous view
    assert kv.shape[1:] == shape
    num_heads = num_kv_heads * group
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    return Case(
        q.to(device), kv[0].to(device), kv[1].to(device),
        torch.tensor(page_ids, **i32), torch.tensor(page_start, **i32),
        torch.tensor(cu, **i32), torch.tensor(kv_lens, **i32),
        head_dim**-0.5, window,
    )  # fmt: skip


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5, rtol: float = 0.0):
    assert torch.isfinite(got).all(), "output holds NaN/inf: a kernel read an unused slot"
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


# --- Triton under the interpreter (fp32, tiny grids) -----------------------------------------

DECODE_CASES = [
    # (seed, kv_lens, group, block_size, window, layout, num_splits, tile_n)
    (0, [1, 7, 13], 1, 4, None, "ragged", 1, 16),
    (1, [5, 33, 18], 4, 8, None, "offsets", 3, 16),
    (2, [40, 9, 0], 8, 4, 11, "ragged", 2, 16),
    (3, [29, 2, 17], 4, 16, 5, "offsets", 1, 32),
    (4, [70, 35], 2, 32, None, "ragged", 2, 16),  # tiles inside one page (scalar page lookup)
]


@pytest.mark.parametrize("seed,kv_lens,group,block_size,window,layout,splits,tile_n", DECODE_CASES)
@pytest.mark.parametrize("heads_first,heads", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_decode_triton_matches_ref(
    seed, kv_lens, group, block_size, window, layout, splits, tile_n, heads_first, heads
):
    """Both program orders (sequence first, KV head first), one or two KV heads a program,
    give the reference's output."""
    c = make_case(seed, kv_lens, [1] * len(kv_lens), group=group, block_size=block_size,
                  window=window, layout=layout)  # fmt: skip
    got = paged_attention_decode_triton(
        *c.args(), c.kv_lens, scale=c.scale, sliding_window=window, num_splits=splits,
        tile_n=tile_n, heads_first=heads_first, heads=heads,
    )  # fmt: skip
    want = c.ref(decode=True)
    assert_close(got, want)
    if 0 in kv_lens:  # no visible key -> zero row
        assert not got[kv_lens.index(0)].any()


PREFILL_CASES = [
    # (seed, kv_lens, q_lens, group, block_size, window): fresh prefill, chunked prefill over
    # cached history, speculative decode rows (q_len 3), plain decode rows (q_len 1).
    (10, [9, 14, 3], [9, 4, 1], 1, 4, None),
    (11, [21, 6, 11], [3, 6, 1], 4, 8, None),
    (12, [17, 12, 5], [7, 3, 0], 8, 4, 6),  # a sequence with no queries this step
    (13, [5, 26, 1], [2, 10, 1], 4, 16, 4),
    # Long runs, so that whole unmasked tiles border the causal diagonal and the window start.
    (14, [40, 45], [16, 40], 1, 8, None),
    (15, [50, 33], [40, 20], 2, 4, 20),
    (16, [70, 20], [30, 20], 4, 32, 45),
]


@pytest.mark.parametrize("seed,kv_lens,q_lens,group,block_size,window", PREFILL_CASES)
def test_prefill_triton_matches_ref(seed, kv_lens, q_lens, group, block_size, window):
    c = make_case(seed, kv_lens, q_lens, group=group, block_size=block_size, window=window,
                  layout="offsets" if seed % 2 else "ragged")  # fmt: skip
    got = paged_attention_prefill_triton(
        *c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale, sliding_window=window,
        max_q_len=max(q_lens), tile_m=16, tile_n=16,
    )  # fmt: skip
    assert_close(got, c.ref(decode=False))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_bf16_triton_matches_ref(decode):
    """bf16 q and caches (the GPU engine's dtypes) under the interpreter, whose bf16 dot the
    suite widens to fp32 (kvplan.ops._interpreter_bf16): the float64 reference over the same bf16
    values within the output's bf16 rounding and the bf16 probabilities."""
    kv_lens = [1, 37, 70, 16]
    q_lens = [1] * 4 if decode else [1, 9, 30, 16]
    c = make_case(30, kv_lens, q_lens, group=4, block_size=8, layout="offsets", head_dim=32,
                  dtype=torch.bfloat16)  # fmt: skip
    if decode:
        got = paged_attention_decode_triton(*c.args(), c.kv_lens, scale=c.scale, num_splits=2,
                                            tile_n=16)  # fmt: skip
    else:
        got = paged_attention_prefill_triton(
            *c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale, max_q_len=max(q_lens),
            tile_m=16, tile_n=16,
        )  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert_close(got, c.ref(decode=decode), atol=4e-3, rtol=8e-3)


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_of_one_query_a_row_runs_the_decode_kernel(window, monkeypatch):
    """Prefill rows of one query each with ``max_q_len = 1`` (the decode rows of a mixed step)
    go to the split-K decode kernel -- the reference again, and the prefill kernel's result
    (forced by a launch override) within fp32 rounding; longer runs or no bound stay on the
    prefill kernel."""
    from kvplan.ops import _paged_attention_kernels as pak

    calls = []
    for name in ("launch_decode", "launch_prefill"):
        real = getattr(pak, name)
        monkeypatch.setattr(pak, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))  # fmt: skip
    c = make_case(41, [1, 23, 9, 40], [1, 1, 1, 1], group=4, block_size=8, layout="offsets",
                  window=window)  # fmt: skip
    args = (*c.args(), c.cu_seqlens_q, c.kv_lens)
    kw = dict(scale=c.scale, sliding_window=window)
    got = paged_attention_prefill_triton(*args, max_q_len=1, **kw)
    assert calls == ["launch_decode"]
    assert_close(got, c.ref(decode=False))
    forced = paged_attention_prefill_triton(*args, max_q_len=1, tile_m=16, **kw)
    assert calls[1:] == ["launch_prefill"]
    assert_close(got, forced, atol=1e-6, rtol=1e-5)
    paged_attention_prefill_triton(*args, **kw)  # no bound: max_q_len = T
    assert calls[2:] == ["launch_prefill"]
    from kvplan.ops import paged_attention as pa

    monkeypatch.setattr(pa, "ONE_QUERY_ROWS_DECODE", False)  # KVPLAN_ONE_QUERY_ROWS_DECODE=0
    paged_attention_prefill_triton(*args, max_q_len=1, **kw)
    assert calls[3:] == ["launch_prefill"]
    monkeypatch.setenv("KVPLAN_ONE_QUERY_ROWS_DECODE", "no")
    with pytest.raises(ValueError, match="KVPLAN_ONE_QUERY_ROWS_DECODE must be 0 or 1, got 'no'"):
        pa.env_flag("KVPLAN_ONE_QUERY_ROWS_DECODE", True)
    with pytest.raises(ValueError, match="max_q_len = 1 is below the longest query run"):
        two = make_case(42, [5, 9], [2, 1], group=2, block_size=4)
        paged_attention_prefill_triton(*two.args(), two.cu_seqlens_q, two.kv_lens, scale=1.0,
                                       max_q_len=1)  # fmt: skip


def test_triton_reads_strided_cache_view():
    """Block stride larger than block_size * Hkv * D (a padded allocation viewed as NHD)."""
    c = make_case(20, [6, 11], [2, 1], group=2, pad_block_stride=3)
    assert not c.k_cache.is_contiguous()
    got = paged_attention_prefill_triton(
        *c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale, tile_m=16, tile_n=16
    )
    assert_close(got, c.ref(decode=False))


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvplan.ops import _paged_attention_kernels as K

def build(kernel, consts, num_warps, num_stages, name=None):
    sig, attrs = {}, {}
    quant = consts.get("KV_QUANT", 0) != 0
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            data = name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "ring_k_ptr", "ring_v_ptr")
            sig[name] = "*bf16" if data else "*fp32" if name.startswith("part") else "*i32"
            if quant and name in ("k_ptr", "v_ptr"):
                sig[name] = "*u8"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith("stride") and name != "stride_sh":
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ir = k.asm["ttgir"]
    tag = kernel.__name__ + {0: "", 1: "_fp8", 2: "_fp4"}[consts.get("KV_QUANT", 0)]
    tag += "_prefetch" if consts.get("PREFETCH") else ""
    tag += {0: "", 1: "_ring", 2: "_ring", 3: "_ring3"}[int(consts.get("RING", 0))]
    print(tag, "async" if "async_copy" in ir else "sync",
          "wgmma" if "warp_group_dot" in ir else "mma")

# bf16, fp8 fp32 sf, fp4 e4m3 sf; quantized pages also with their bytes loaded a tile ahead,
# and with the recent-window ring
for quant, sf, group, pre, ring in ((0, 0, 1, False, False), (1, 2, 32, False, False),
                                    (2, 1, 16, False, False), (1, 2, 32, True, False),
                                    (2, 1, 16, True, False), (0, 0, 1, False, True),
                                    (1, 2, 32, True, True)):
    common = dict(BLOCK_SIZE=32, HEAD_DIM=128, DOT_PRECISION="tf32", INTERPRET=False,
                  KV_QUANT=quant, SF_KIND=sf, GROUP=group, PREFETCH=pre, RING=ring)
    decode = dict(TILE_M=16, TILE_N=64, SPLIT=True, HEADS_FIRST=False, HEADS=1,
                  **{**common, "RING": 2 if ring else 0})
    build(K._decode_kernel, decode, 4, 2)
    if ring:  # the ring's own launch
        build(K._decode_kernel, {**decode, "RING": 3}, 4, 2)
    build(K._prefill_kernel, dict(TILE_M=128, TILE_N=64, **common), 8, 3)
build(K._combine_kernel, dict(SPLITS_PAD=4, HEAD_DIM=128), 4, 1)
"""


def test_kernels_compile_for_sm90():
    """The interpreter skips Triton's type checks and layouts: compile the real thing for the
    H200 (sm_90, no GPU needed), for bf16 caches and for fp8 / fp4 pages, and check that K/V
    loads are pipelined (cp.async) and the prefill dots use wgmma."""
    import os
    import subprocess
    import sys

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - no CUDA toolchain in this Triton install
        pytest.skip(f"no ptxas: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.split("\n")
    for suffix in (
        "",
        "_fp8",
        "_fp4",
        "_fp8_prefetch",
        "_fp4_prefetch",
        "_ring",
        "_fp8_prefetch_ring",
    ):
        assert f"_decode_kernel{suffix} async mma" in lines
        assert f"_prefill_kernel{suffix} async wgmma" in lines
    assert any(line.startswith("_combine_kernel") for line in lines)
    assert any(line.startswith("_decode_kernel_fp8_prefetch_ring3 ") for line in lines)


# --- torch path (many random cases, still fast) ----------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_torch_paths_match_ref(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 5, (), generator=gen))
    kv_lens = torch.randint(1, 40, (batch,), generator=gen).tolist()
    q_lens = [int(torch.randint(1, n + 1, (), generator=gen)) for n in kv_lens]
    group = [1, 4, 8][seed % 3]
    window = [None, 1, 7][seed % 3 - 1]
    c = make_case(seed, kv_lens, q_lens, group=group, block_size=[1, 4, 16][seed % 3],
                  window=window, layout=["ragged", "offsets"][seed % 2], head_dim=32)  # fmt: skip
    got = paged_attention_prefill_torch(
        *c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale, sliding_window=window
    )
    assert_close(got, c.ref(decode=False))
    d = make_case(seed, kv_lens, [1] * batch, group=group, window=window, layout="ragged")
    got = paged_attention_decode_torch(*d.args(), d.kv_lens, scale=d.scale, sliding_window=window)
    assert_close(got, d.ref(decode=True))


def test_torch_path_reuses_a_plan_only_for_the_same_page_table():
    """The torch path keeps each step's gather plan for the step's other layers: a call with
    another page table, window or length -- also one written into the same tensors in
    place, as the backends' buffers are (through numpy: no version bump) -- recomputes it;
    the same table gives the same plan and output."""
    import kvplan.ops.paged_attention as pa

    c = make_case(40, [9, 14, 3], [1, 1, 1], group=2, block_size=4, reserve=2)
    args = (c.q, c.k_cache, c.v_cache)
    page_ids, page_start, kv_lens = c.page_ids.clone(), c.page_start.clone(), c.kv_lens.clone()

    def check(window=None):
        got = paged_attention_decode_torch(*args, page_ids, page_start, kv_lens, scale=c.scale,
                                           sliding_window=window)  # fmt: skip
        want = paged_attention_ref(*args, page_ids.clone(), page_start.clone(), None,
                                   kv_lens.clone(), scale=c.scale, sliding_window=window)  # fmt: skip
        assert_close(got, want)
        return got

    first = check()
    plans = dict(pa._PLANS)
    assert torch.equal(check(), first)
    assert all(pa._PLANS.get(k) is v for k, v in plans.items())  # reused, not rebuilt
    table = page_ids.numpy()  # in place, as a backend's staged buffers are written
    s1 = int(page_start[1])
    table[[s1, s1 + 1]] = table[[s1 + 1, s1]]  # sequence 1's first two (full) pages swapped
    assert not torch.equal(check(), first)
    kv_lens.numpy()[1] = 6  # a shorter sequence
    check()
    page_start.numpy()[[0, 1]] = page_start.numpy()[[1, 0]]  # two sequences' tables swapped
    kv_lens.numpy()[[0, 1]] = kv_lens.numpy()[[1, 0]]
    for window in (3, None, 3):  # layers of two windows alternate
        check(window)


def test_dispatch_on_cpu_is_torch_path_and_out_is_written_in_place():
    c = make_case(30, [5, 12], [1, 1], group=4)
    out = torch.empty_like(c.q)
    res = paged_attention_decode(*c.args(), c.kv_lens, scale=c.scale, out=out)
    assert res is out
    assert torch.equal(out, paged_attention_decode_torch(*c.args(), c.kv_lens, scale=c.scale))
    p = make_case(31, [5, 12], [5, 2], group=4)
    out = torch.empty_like(p.q)
    res = paged_attention_prefill(*p.args(), p.cu_seqlens_q, p.kv_lens, scale=p.scale, out=out)
    assert res is out
    assert_close(out, p.ref(decode=False))


def test_ragged_and_block_offset_encodings_give_identical_outputs():
    """Same seed -> same blocks and data; only the page-table encoding differs."""
    kw = dict(group=4, block_size=4, window=None)
    a = make_case(40, [13, 3, 8], [4, 1, 2], layout="ragged", **kw)
    b = make_case(40, [13, 3, 8], [4, 1, 2], layout="offsets", **kw)
    assert not torch.equal(a.page_start, b.page_start)
    outs = [
        paged_attention_prefill_torch(*c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale)
        for c in (a, b)
    ]
    assert torch.equal(outs[0], outs[1])


def test_decode_heads_rule(monkeypatch):
    """`decode_heads`: an explicit count that does not fit raises naming it; the module default
    (``KVPLAN_DECODE_HEADS``) falls back to 1 where it does not fit; the launch takes it."""
    c = make_case(5, [9, 30], [1, 1], num_kv_heads=4, group=4, block_size=8)
    geo = kv_geometry(c.k_cache, c.v_cache, 16, None)
    assert pak.decode_heads(geo, 16, 4, None) == 1
    assert pak.decode_heads(geo, 16, 4, 4) == 4
    for bad in (3, 8, 0):  # not a power of two / 32 rows / not a count
        with pytest.raises(ValueError, match=f"heads={bad}"):
            pak.decode_heads(geo, 16, 4, bad)
    strided = geo._replace(stride_kh=32)  # a plain cache whose heads are not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        pak.decode_heads(strided, 16, 4, 2)
    wide = geo._replace(stride_kh=128, stride_vh=128)
    assert pak.decode_heads(wide, 128, 4, 2, 2) == 2  # bf16: 512 bytes a key
    with pytest.raises(ValueError, match="heads=2 .* 4 a value"):  # fp32: 1 KB a key
        pak.decode_heads(wide, 128, 4, 2, 4)
    with pytest.raises(ValueError, match="heads=4 .* columns <= 256"):
        pak.decode_heads(wide, 128, 4, 4, 2)
    assert pak.decode_heads(wide._replace(kv_quant=1), 128, 4, 2, 1) == 2  # fp8 records
    monkeypatch.setattr(pak, "DECODE_HEADS", 4)
    assert pak.decode_heads(geo, 16, 4, None) == 4
    assert pak.decode_heads(strided, 16, 4, None) == 1
    assert pak.decode_heads(geo, 16, 8, None) == 1  # 32 rows: falls back
    assert pak.decode_heads(wide, 128, 4, None, 4) == 1  # an fp32 cache's 1 KB: falls back
    seen = []
    real = pak.launch_decode
    monkeypatch.setattr(
        pak, "launch_decode", lambda *a, **k: seen.append(k["heads"]) or real(*a, **k)
    )
    got = paged_attention_decode_triton(*c.args(), c.kv_lens, scale=c.scale, num_splits=2)
    assert seen == [4]
    assert_close(got, c.ref(decode=True))
    monkeypatch.setenv("KVPLAN_DECODE_HEADS", "3")
    with pytest.raises(ValueError, match="KVPLAN_DECODE_HEADS must be one of"):
        pak._heads_from_env()


def test_default_num_splits():
    assert default_num_splits(64, 8, 4096, 132) == 1
    assert default_num_splits(4, 8, 4096, 132) == 9
    assert default_num_splits(1, 8, 4096, 132) == 16  # capped at 256 keys per split
    assert default_num_splits(256, 8, 4096, 132) == 1
    assert default_num_splits(1, 1, 300, 132) == 1  # >= 256 keys per split
    assert default_num_splits(1, 1, 10**6, 132) == 64


def test_decode_splits_override(monkeypatch):
    """``KVPLAN_DECODE_SPLITS`` (read at import) replaces the rule; a bad value names itself."""
    import kvplan.ops.paged_attention as pa

    monkeypatch.setattr(pa, "SPLITS_OVERRIDE", 5)
    assert pa.default_num_splits(64, 8, 4096, 132) == 5
    monkeypatch.setenv("KVPLAN_DECODE_SPLITS", "3")
    assert pa._splits_from_env() == 3
    monkeypatch.setenv("KVPLAN_DECODE_SPLITS", "0")
    with pytest.raises(ValueError, match="KVPLAN_DECODE_SPLITS.*'0'"):
        pa._splits_from_env()


# --- caller errors ---------------------------------------------------------------------------


def _bad(c: Case, **changes):
    args = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, page_ids=c.page_ids,
                page_start=c.page_start, cu_seqlens_q=c.cu_seqlens_q, kv_lens=c.kv_lens)  # fmt: skip
    args.update(changes)
    return paged_attention_prefill(**args, scale=c.scale)


@pytest.mark.parametrize(
    "change,err,match",
    [
        (lambda c: dict(page_ids=c.page_ids.long()), TypeError, "page_ids"),
        (lambda c: dict(q=c.q.double()), TypeError, "q"),
        (lambda c: dict(k_cache=c.k_cache.half()), TypeError, "k_cache"),
        (lambda c: dict(q=c.q[:, :3]), ValueError, "num_heads 3"),
        (lambda c: dict(kv_lens=c.kv_lens[:1]), ValueError, "page_start"),
        (lambda c: dict(page_ids=c.page_ids + 1000), ValueError, "page_ids"),
        (lambda c: dict(kv_lens=c.kv_lens + 100), ValueError, "needs page_ids"),
        (lambda c: dict(cu_seqlens_q=c.cu_seqlens_q * 2), ValueError, "cu_seqlens_q"),
        (lambda c: dict(kv_lens=c.kv_lens - 4), ValueError, "queries but kv_lens"),
    ],
)
def test_caller_errors_name_the_field(change, err, match):
    c = make_case(50, [6, 9], [3, 3], group=2)
    with pytest.raises(err, match=match):
        _bad(c, **change(c))


def test_only_page_entries_in_use_are_checked():
    c = make_case(52, [6, 9], [1, 1], group=2, layout="ragged", reserve=0)
    tail = torch.full((5,), -7, dtype=torch.int32)  # garbage past the used prefix: fine
    page_ids = torch.cat([c.page_ids, tail])
    got = paged_attention_decode(c.q, c.k_cache, c.v_cache, page_ids, c.page_start, c.kv_lens,
                                 scale=c.scale)  # fmt: skip
    assert_close(got, c.ref(decode=True))
    page_ids[1] = -7  # an entry sequence 0 reads
    with pytest.raises(ValueError, match="page_ids"):
        paged_attention_decode(c.q, c.k_cache, c.v_cache, page_ids, c.page_start, c.kv_lens,
                               scale=c.scale)  # fmt: skip


def test_scalar_argument_errors():
    c = make_case(51, [6], [1])
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_decode(*c.args(), c.kv_lens, scale=c.scale, sliding_window=0)
    with pytest.raises(ValueError, match="scale"):
        paged_attention_decode(*c.args(), c.kv_lens, scale=float("nan"))
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode_triton(*c.args(), c.kv_lens, scale=c.scale, num_splits=0)


# --- GPU (bf16 within 1e-2 relative; fp32 within 1e-5) ---------------------------------------


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "group,window,splits", [(1, None, 1), (4, None, 7), (8, 100, 3), (4, None, None)]
)
def test_decode_gpu(group, window, splits):
    gen = torch.Generator().manual_seed(group)
    kv_lens = torch.randint(1, 1200, (24,), generator=gen).tolist() + [1, 16, 17, 0]
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        c = make_case(group, kv_lens, [1] * len(kv_lens), num_kv_heads=4, group=group,
                      head_dim=128, block_size=16, window=window, dtype=dtype, device="cuda")  # fmt: skip
        got = paged_attention_decode(*c.args(), c.kv_lens, scale=c.scale, sliding_window=window,
                                     num_splits=splits)  # fmt: skip
        assert torch.isfinite(got).all()
        want = paged_attention_decode_torch(*c.args(), c.kv_lens, scale=c.scale,
                                            sliding_window=window)  # fmt: skip
        assert _rel_err(got, want) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("group,window,block_size", [(1, None, 16), (4, 64, 32), (8, None, 8)])
def test_prefill_gpu(group, window, block_size):
    gen = torch.Generator().manual_seed(7 + group)
    kv_lens = torch.randint(1, 700, (10,), generator=gen).tolist() + [1, 300, 300]
    q_lens = [int(torch.randint(1, n + 1, (), generator=gen)) for n in kv_lens[:-3]] + [1, 3, 300]
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        c = make_case(group, kv_lens, q_lens, num_kv_heads=2, group=group, head_dim=64,
                      block_size=block_size, window=window, dtype=dtype, device="cuda",
                      layout="offsets")  # fmt: skip
        got = paged_attention_prefill(*c.args(), c.cu_seqlens_q, c.kv_lens, scale=c.scale,
                                      sliding_window=window)  # fmt: skip
        assert torch.isfinite(got).all()
        want = paged_attention_prefill_torch(*c.args(), c.cu_seqlens_q, c.kv_lens,
                                             scale=c.scale, sliding_window=window)  # fmt: skip
        assert _rel_err(got, want) < tol


@pytest.mark.gpu
def test_gpu_small_cases_match_ref_and_cuda_graph_replay():
    c = make_case(60, [1, 7, 13, 40], [1, 1, 1, 1], group=4, head_dim=32, device="cuda")
    want = c.ref(decode=True)
    assert_close(paged_attention_decode(*c.args(), c.kv_lens, scale=c.scale, num_splits=2), want)
    h = make_case(61, [5, 70], [2, 33], group=2, head_dim=64, dtype=torch.float16, device="cuda")
    got = paged_attention_prefill(*h.args(), h.cu_seqlens_q, h.kv_lens, scale=h.scale)
    assert _rel_err(got, h.ref(decode=False)) < 1e-2
    out = torch.zeros_like(c.q)
    run = lambda: paged_attention_decode(*c.args(), c.kv_lens, scale=c.scale, out=out,  # noqa: E731
                                         num_splits=2, check=False)  # fmt: skip
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, want)


def test_decode_tiling_defaults_overrides_and_env(monkeypatch) -> None:
    """Per-format defaults, explicit overrides, ``KVPLAN_DECODE_TILING`` parsing with a clear
    error, and range checks naming the argument."""
    from kvplan.ops import _paged_kv_tiles as tiles

    assert tiles.decode_tiling(None) == tiles.DECODE_TILING[None]
    fp8 = types.SimpleNamespace(quantized_dtype="e4m3")
    assert tiles.decode_tiling(fp8, heads=2) == tiles.DECODE_TILING_HEADS[("e4m3", 2)]
    assert tiles.decode_tiling(fp8, heads=8) == tiles.DECODE_TILING["e4m3"]  # no entry
    assert tiles.decode_tiling(fp8, num_warps=4, heads=2) == (32, 4, 3)
    assert tiles.decode_tiling(None, tile_n=32, num_warps=8, num_stages=2) == (32, 8, 2)
    monkeypatch.setenv("KVPLAN_DECODE_TILING", "32,4,3")
    assert tiles._tiling_from_env() == (32, 4, 3)
    monkeypatch.setenv("KVPLAN_DECODE_TILING", "32,4")
    with pytest.raises(ValueError, match="KVPLAN_DECODE_TILING.*'32,4'"):
        tiles._tiling_from_env()
    monkeypatch.setattr(tiles, "TILING_OVERRIDE", (16, 2, 2))
    assert tiles.decode_tiling(None) == (16, 2, 2)
    with pytest.raises(ValueError, match="tile_n must be a power of two"):
        tiles.decode_tiling(None, tile_n=48)
    with pytest.raises(ValueError, match="num_warps"):
        tiles.decode_tiling(None, num_warps=3)


def test_decode_maxnreg_defaults_overrides_and_env(monkeypatch) -> None:
    """The decode register cap: none by default, an explicit cap wins, 0 means none,
    ``KVPLAN_DECODE_MAXNREG`` parsing and range checks with clear errors; a capped launch
    gives the uncapped result (the interpreter ignores the cap; the GPU test runs it)."""
    from kvplan.ops import _paged_kv_tiles as tiles

    monkeypatch.setattr(tiles, "MAXNREG_OVERRIDE", None)
    monkeypatch.setattr(tiles, "DECODE_MAXNREG", {"e4m3": 168})
    assert tiles.decode_maxnreg(None) is None
    assert tiles.decode_maxnreg(None, 128) == 128
    assert tiles.decode_maxnreg(None, 0) is None
    fp8 = type("L", (), {"quantized_dtype": "e4m3"})()
    assert tiles.decode_maxnreg(fp8) == 168
    assert tiles.decode_maxnreg(fp8, 0) is None
    monkeypatch.setattr(tiles, "MAXNREG_OVERRIDE", 0)
    assert tiles.decode_maxnreg(fp8) is None
    with pytest.raises(ValueError, match="maxnreg must be .* got 300"):
        tiles.decode_maxnreg(None, 300)
    monkeypatch.setenv("KVPLAN_DECODE_MAXNREG", "128")
    assert tiles._maxnreg_from_env() == 128
    for bad in ("12", "x", "256"):
        monkeypatch.setenv("KVPLAN_DECODE_MAXNREG", bad)
        with pytest.raises(ValueError, match=f"KVPLAN_DECODE_MAXNREG .* got '{bad}'"):
            tiles._maxnreg_from_env()
    # the launch plan: a format's cap only where it brings more resident splits
    from kvplan.ops import paged_attention as pa

    monkeypatch.setattr(tiles, "MAXNREG_OVERRIDE", None)
    monkeypatch.setattr(pa, "SPLITS_OVERRIDE", None)
    plan = lambda batch, splits=None, cap=None, layout=fp8: pa._decode_launch_plan(  # noqa: E731
        layout, batch, 8, 8192, 132, 2, splits, cap
    )
    assert plan(32) == (3, 168)  # 256 pairs: 2 plain splits, 6 capped programs an SM: 3
    assert plan(64) == (1, None)  # 512 pairs fill both: no cap
    assert plan(32, splits=2) == (2, None)  # a given split count keeps the table's cap off
    assert plan(32, cap=0) == (2, None)
    assert plan(32, layout=None) == (2, None)
    assert plan(32, cap=168, layout=None) == (3, 168)  # a given cap always applies
    assert plan(32, splits=2, cap=168) == (2, 168)
    # fp4 pages read as fp16 tiles have their own key (128 registers: 8 programs an SM)
    monkeypatch.setattr(tiles, "DECODE_MAXNREG", {"e4m3": 168, "e2m1_f16": 128})
    fp4 = type("L", (), {"quantized_dtype": "e2m1"})()
    assert tiles.decode_maxnreg(fp4) is None
    assert tiles.decode_maxnreg(fp4, key="e2m1_f16") == 128
    assert pa._decode_launch_plan(fp4, 32, 8, 8192, 132, 2, None, None, "e2m1_f16") == (4, 128)
    assert pa._decode_launch_plan(fp4, 32, 8, 8192, 132, 2, None, None) == (2, None)
    # ... whose cap also applies to a given split count (DECODE_MAXNREG_ALWAYS), fp8's not
    assert pa._decode_launch_plan(fp4, 32, 8, 8192, 132, 2, 4, None, "e2m1_f16") == (4, 128)
    assert pa._decode_launch_plan(fp4, 64, 8, 8192, 132, 2, None, None, "e2m1_f16") == (2, 128)
    assert pa._decode_launch_plan(fp4, 32, 8, 8192, 132, 2, 4, 0, "e2m1_f16") == (4, None)
    assert plan(32, splits=4) == (4, None)
    monkeypatch.setattr(tiles, "MAXNREG_OVERRIDE", 0)
    assert plan(32) == (2, None)
    assert pa.resident_splits(32, 8, 8192, 132, 6) == 3
    assert pa.resident_splits(32, 8, 512, 132, 6) == 2  # >= 256 keys a split
    assert pa.resident_splits(200, 8, 8192, 132, 6) == 1
    c = make_case(62, [3, 40], [1, 1], group=4, head_dim=32)
    want = paged_attention_decode_triton(*c.args(), c.kv_lens, scale=c.scale, num_splits=2)
    got = paged_attention_decode_triton(*c.args(), c.kv_lens, scale=c.scale, num_splits=2,
                                        maxnreg=128)  # fmt: skip
    assert torch.equal(got, want)
