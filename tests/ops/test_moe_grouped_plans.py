"""Launch plans of the grouped MoE GEMMs: every plan computes the same result (interpreter,
fp32), the plan table's validation, and the half-precision specializations compiled for
sm_90 without register spills.

The sm_90 compiles run in a fresh process without ``TRITON_INTERPRET`` (see
``tests/sm90_compile.py``) with the launch's integer specialization: pointers and the sizes
and row stride divisible by 16.
"""

from __future__ import annotations

import pytest
import torch

import kvplan.ops._moe_grouped_kernels as gk
import kvplan.ops.moe_grouped as mg
from kvplan.ops.moe_grouped import (
    PLANS,
    GemmTiles,
    GroupedPlan,
    grouped_plan,
    moe_grouped_torch,
    moe_grouped_triton,
)
from tests.sm90_compile import kernel_arg_names, sm90_stats

LIMIT = 1.5


def _case(seed, t, e, k, hidden, inter):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(e, hidden, inter, generator=gen) * 0.3
    ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k]
    ids[: t // 2] = torch.randint(0, 2, (t // 2, k), generator=gen)  # skewed: multi-tile experts
    w = torch.rand(t, k, generator=gen) + 0.1
    return x, ids, w, gate_up, down


T16 = GemmTiles(16, 16, 4, 1)
PLAN_CASES = [  # (plan, hidden, inter): even and ragged K / N, both grid orders, stages
    (GroupedPlan(16, T16, T16), 32, 32),
    (GroupedPlan(16, T16, GemmTiles(16, 16, 4, 1, True)), 32, 32),
    (GroupedPlan(32, GemmTiles(16, 32, 4, 3, True), GemmTiles(32, 16, 4, 2, True)), 40, 24),
    (GroupedPlan(16, GemmTiles(32, 16, 8, 4), T16), 24, 48),
]


@pytest.mark.parametrize("plan, hidden, inter", PLAN_CASES)
def test_plans_match_the_torch_path(plan, hidden, inter):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(hidden + inter, 37, 5, 2, hidden, inter)
    want = moe_grouped_torch(x, ids, w, gate_up, down, LIMIT)
    assert want.abs().max() > 0.1
    args = [v.to(dev) for v in (x, ids, w, gate_up, down)]
    got = moe_grouped_triton(*args, LIMIT, plan=plan).cpu()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_plan_table_and_validation(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert grouped_plan(2 * 8192, 16, torch.bfloat16) == PLANS["prefill"]
    assert grouped_plan(2 * 1024, 16, torch.bfloat16) == PLANS["prefill"]
    small = grouped_plan(2 * 32, 16, torch.bfloat16)  # decode: the half plan, M of 16
    assert small.block_m == 16 and small.gate_up == PLANS["half"].gate_up
    assert grouped_plan(2 * 8192, 16, torch.float32).block_m == 64  # fp32 never "prefill"
    with pytest.raises(ValueError, match="block_n"):
        GemmTiles(48, 64)
    with pytest.raises(ValueError, match="num_stages"):
        GemmTiles(64, 64, 4, 0)
    with pytest.raises(ValueError, match="block_m"):
        GroupedPlan(0, T16, T16)
    with pytest.raises(TypeError, match="down"):
        GroupedPlan(16, T16, (16, 16))
    x, ids, w, gate_up, down = _case(0, 4, 3, 2, 16, 16)
    with pytest.raises(TypeError, match="plan"):
        moe_grouped_triton(x, ids, w, gate_up, down, LIMIT, plan=(16, 16, 16))


@pytest.mark.parametrize("t, k, e", [(0, 2, 4), (1, 1, 1), (33, 2, 16), (57, 6, 64), (9, 18, 5)])
def test_counting_sort_equals_the_radix_sort(monkeypatch, t, k, e):
    gen = torch.Generator().manual_seed(t + k + e)
    ids = torch.randint(0, e, (t, k), generator=gen)
    if t > 2:
        ids[: t // 3] = ids[0, 0]  # one expert many times, within and across tokens
    for block_m in (1, 16):
        monkeypatch.setattr(mg, "COUNT_SORT_MAX_CELLS", 1 << 23)
        counted = mg.group_pairs(ids, e, block_m)
        monkeypatch.setattr(mg, "COUNT_SORT_MAX_CELLS", 0)
        sorted_ = mg.group_pairs(ids, e, block_m)
        monkeypatch.undo()
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # independent: torch's stable sort
        assert torch.equal(counted.order, order) and torch.equal(sorted_.order, order)
        for name, a, b in zip(counted._fields, counted, sorted_):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize(
    "t, k, e, block_m",
    [(0, 2, 4, 16), (1, 1, 1, 16), (33, 2, 16, 16), (57, 6, 64, 16), (9, 18, 5, 4),
     (9, 3, 7, 1), (300, 2, 16, 128), (40, 8, 256, 64)],
)  # fmt: skip
def test_triton_grouping_equals_the_torch_grouping(t, k, e, block_m):
    """The three-launch grouping gives `group_pairs`' tensors bit for bit (several chunks,
    several expert blocks in the scan, repeated experts within and across tokens, k above 16)
    and the routing weights in torch's stable sort order."""
    gen = torch.Generator().manual_seed(t + k + e)
    ids = torch.randint(0, e, (t, k), generator=gen)
    if t > 2:
        ids[: t // 3] = ids[0, 0]
    w = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    ref = mg.group_pairs(ids, e, block_m)
    got, w_sorted = mg.group_pairs_triton(ids, e, block_m, w)
    for name, a, b in zip(ref._fields, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    order = torch.sort(ids.reshape(-1), stable=True).indices  # independent: torch's sort
    assert torch.equal(got.order, order)
    assert w_sorted.dtype == w.dtype and torch.equal(w_sorted, w.reshape(-1)[order])
    assert mg.group_pairs_triton(ids, e, block_m)[1] is None


def test_triton_grouping_errors():
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_m"):
        mg.group_pairs_triton(ids, 4, 0)
    with pytest.raises(ValueError, match="num_experts"):
        mg.group_pairs_triton(ids, 0, 16)
    with pytest.raises(TypeError, match="ids"):
        mg.group_pairs_triton(ids.int(), 4, 16)
    with pytest.raises(ValueError, match="weights"):
        mg.group_pairs_triton(ids, 4, 16, torch.zeros(3, 3))


# ---- sm_90 compiles ------------------------------------------------------------------------


def compile_stats(name: str, plan: GroupedPlan, k_size: int, n_size: int) -> tuple:
    """(registers, spill store bytes, uses wgmma, shared bytes, loads asynchronous) of
    kernel ``name`` compiled for sm_90 at ``plan`` over bf16 operands, reduction size
    ``k_size``, ``n_size`` columns."""
    tiles = plan.gate_up if name == "grouped_gate_up_kernel" else plan.down
    const = dict(BLOCK_M=plan.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                 K_TILES=-(-k_size // tiles.block_k), EVEN_K=k_size % tiles.block_k == 0,
                 EVEN_N=n_size % tiles.block_n == 0, N_MAJOR=tiles.n_major,
                 DOT_PRECISION="tf32", UPCAST=False)  # fmt: skip
    fn = getattr(gk, name)
    names = kernel_arg_names(fn)
    sig = {n: "*bf16" for n in ("x_ptr", "w_ptr", "h_ptr", "c_ptr")}
    sig.update(wt_ptr="*fp32", limit="fp32")
    div16 = {n for n in names if n.endswith("_ptr") or n in ("hidden", "inter", "stride_x")}
    st = sm90_stats(fn, const, signature=sig, div16=div16, num_warps=tiles.num_warps,
                    num_stages=tiles.num_stages)  # fmt: skip
    return st.registers, st.spill_bytes, st.wgmma, st.shared_bytes, st.cp_async


# DeepSeek-V4 sizes (hidden 2048, expert width 1024) at the half and prefill plans
@pytest.mark.parametrize("regime", ["half", "prefill"])
@pytest.mark.parametrize(
    "name, k_size, n_size",
    [("grouped_gate_up_kernel", 2048, 1024), ("grouped_down_kernel", 1024, 2048)],
    ids=["gate_up", "down"],
)
def test_bf16_plans_compile_for_sm90_without_spills(regime, name, k_size, n_size):
    plan = PLANS[regime]
    regs, spills, wgmma, shared, pipelined = compile_stats(name, plan, k_size, n_size)
    assert spills == 0, f"{regs} registers, {spills} bytes spilled"
    assert wgmma, "bf16 dots not on the sm_90 tensor-core (wgmma) path"
    assert shared <= 227 * 1024, shared  # an H200 block's shared memory
    tiles = plan.gate_up if name == "grouped_gate_up_kernel" else plan.down
    assert pipelined == (tiles.num_stages > 1), "K loop loads not software-pipelined"


@pytest.mark.gpu
def test_prefill_plan_on_cuda_matches_the_decode_plan_and_torch():
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, e, k, hidden, inter = 2048, 16, 2, 512, 256
    x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen, device="cuda") * 0.05).bfloat16()
    down = (torch.randn(e, hidden, inter, generator=gen, device="cuda") * 0.05).bfloat16()
    ids = torch.rand(t, e, generator=gen, device="cuda").argsort(-1)[:, :k]
    ids[: t // 4] = torch.tensor([0, 1], device="cuda")  # a crowded expert pair
    w = torch.rand(t, k, generator=gen, device="cuda").bfloat16()
    assert grouped_plan(t * k, e, torch.bfloat16) == PLANS["prefill"]
    got = moe_grouped_triton(x, ids, w, gate_up, down, LIMIT)
    small = moe_grouped_triton(x, ids, w, gate_up, down, LIMIT, plan=PLANS["half"])
    ref = moe_grouped_torch(x, ids, w, gate_up, down, LIMIT)
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** float(torch.floor(torch.log2(ref.abs().max())))
    assert float((got.double() - ref.double()).abs().max()) <= 2 * ulp
    assert float((got.double() - small.double()).abs().max()) <= 2 * ulp
