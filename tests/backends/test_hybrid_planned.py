"""PlannedHybridFamily equals an independent per-token oracle (exact format), and every query
row sees exactly DESIGN.md's visible set, over random step schedules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_oracle import Driver, HybridOracle, make_layers

from kvplan.backends.hybrid.planned import PlannedHybridFamily

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
MAX_LEN = 96


def make_family(kinds, window, hca_ratio, *, kv_format="exact", index_format=None,
                decode_builder="eager", trace=True, device="cpu", ring_size=None,
                **kw):  # fmt: skip
    layers = make_layers(kinds, window, {CSA: 4, HCA: hca_ratio}, **kw)
    fam = PlannedHybridFamily(
        layers, block_size=16, num_blocks=64, num_state_slots=8, max_model_len=MAX_LEN,
        kv_format=kv_format, index_format=index_format, decode_builder=decode_builder,
        check=True, trace=trace and kv_format == "exact", device=device, ring_size=ring_size,
    )  # fmt: skip
    main = None if kv_format == "exact" else kv_format
    index = (
        None if kv_format == "exact" else (index_format or ("fp4" if main == "fp4" else "mxfp8"))
    )
    return fam, HybridOracle(layers, window, main, index)


def chunked(rng, rid, total, budget, start=0):
    """Steps of a prompt of ``total`` tokens in random chunks of at most ``budget``."""
    steps, q = [], start
    while q < total:
        n = int(min(rng.integers(1, budget + 1), total - q))
        steps.append([(rid, q, n)])
        q += n
    return steps


def schedules(rng) -> dict[str, list]:
    """Each schedule: steps of ``(rid, q_start, seqlen_q[, new_slot])``."""
    out = {}
    out["long_prompt"] = [[(0, 0, 45)], [(0, 45, 1)], [(0, 46, 1)]]
    out["chunked"] = chunked(rng, 0, 41, 6) + [[(0, 41 + k, 1)] for k in range(5)]
    decode = [[(0, 0, 9)]] + [[(0, 9 + k, 1)] for k in range(23)]
    out["decode"] = decode
    mixed = [[(0, 0, 13)], [(0, 13, 7), (1, 0, 6)], [(0, 20, 1), (1, 6, 9), (2, 0, 3)]]
    mixed += [[(0, 21, 1), (1, 15, 1), (2, 3, 1)], [(0, 22, 1), (1, 16, 1), (2, 4, 11)]]
    mixed += [[(0, 23 + k, 1), (1, 17 + k, 1), (2, 15 + k, 1)] for k in range(6)]
    out["mixed"] = mixed
    restart = chunked(rng, 0, 22, 5) + [[(0, 22, 1)], [(0, 23, 1)]]
    restart += [[(0, 0, 17, True)], [(0, 17, 3)], [(0, 20, 1)]]  # preempted, recomputed
    restart += [[(0, 0, 12)], [(0, 12, 1)]]  # recomputed again in the same slot
    out["restart"] = restart
    return out


def run(fam, oracle, steps, seed, atol=1e-5, rtol=1e-5):
    drv = Driver(fam, oracle, seed=seed, atol=atol, rtol=rtol)
    for step in steps:
        seqs = [drv.seq(e[0], e[1], e[2], bool(e[3]) if len(e) > 3 else False) for e in step]
        drv.step(seqs)
    return drv


LAYER_SETS = [
    ([SLIDING, CSA, HCA, CSA], 8),
    ([HCA, CSA, SLIDING], 16),
    ([CSA, HCA], 8),
]


@pytest.mark.parametrize("name", ["long_prompt", "chunked", "decode", "mixed", "restart"])
@pytest.mark.parametrize("layer_set", range(len(LAYER_SETS)))
def test_planned_equals_oracle(name: str, layer_set: int) -> None:
    kinds, hca_ratio = LAYER_SETS[layer_set]
    rng = np.random.default_rng(layer_set)
    window = int(rng.integers(3, 9))
    fam, oracle = make_family(kinds, window, hca_ratio)
    drv = run(fam, oracle, schedules(rng)[name], seed=layer_set * 7 + len(name))
    assert drv.rows_checked > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_schedule_device_decode_builder(seed: int) -> None:
    """Random mixes of prefill chunks and decode rows; decode steps planned by
    ``prepare_decode_on_device`` (torch backend on CPU); HCA ratios 4, 8, 16."""
    rng = np.random.default_rng(100 + seed)
    hca_ratio = (4, 8, 16)[seed]  # 4: one ratio both dense and sparse
    fam, oracle = make_family([CSA, HCA, SLIDING], int(rng.integers(2, 7)), hca_ratio,
                              decode_builder="device", top_k=int(rng.integers(1, 5)))  # fmt: skip
    lengths = {rid: int(rng.integers(10, 40)) for rid in range(3)}
    done = {rid: 0 for rid in lengths}
    steps = []
    while any(done[r] < MAX_LEN - 8 for r in done):
        step = []
        for rid in lengths:
            if done[rid] >= MAX_LEN - 8 or rng.random() < 0.3:
                continue
            left = lengths[rid] - done[rid]
            n = int(rng.integers(1, 8)) if left > 0 else 1
            n = min(n, max(left, 1), MAX_LEN - 8 - done[rid])
            step.append((rid, done[rid], n))
            done[rid] += n
        if step:
            steps.append(step)
    drv = run(fam, oracle, steps, seed=seed)
    assert drv.rows_checked > 100


def test_ring_larger_than_window() -> None:
    rng = np.random.default_rng(9)
    fam, oracle = make_family([SLIDING, CSA, HCA], 4, 8, ring_size=7)
    drv = run(fam, oracle, schedules(rng)["mixed"], seed=9)
    assert fam.config.swa_block_size == 7 and drv.rows_checked > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
@pytest.mark.parametrize("name", ["chunked", "mixed", "restart"])
def test_planned_equals_oracle_cuda(kv_format: str, name: str) -> None:
    """The same equality on CUDA: Triton store / load / index kernels, decode metadata from
    ``prepare_decode_on_device`` (the oracle stays on the CPU)."""
    rng = np.random.default_rng(3)
    fam, oracle = make_family([SLIDING, CSA, HCA], 5, 8, kv_format=kv_format, device="cuda",
                              decode_builder="auto")  # fmt: skip
    assert fam.decode_builder == "device"
    tol = 1e-5 if kv_format == "exact" else 2e-5
    run(fam, oracle, schedules(rng)[name], seed=3, atol=tol, rtol=tol)


def test_wrong_continuation_is_refused() -> None:
    fam, oracle = make_family([SLIDING, HCA], 4, 8)
    drv = run(fam, oracle, [[(0, 0, 5)]], seed=0)
    with pytest.raises(ValueError, match="q_start = 7"):
        fam.plan([drv.seq(0, 7, 1)], torch.tensor([7]))
    fam.free(0)
    with pytest.raises(ValueError, match="caches hold None"):
        fam.plan([drv.seq(0, 5, 1)], torch.tensor([5]))


def test_call_order_is_checked() -> None:
    fam, _ = make_family([CSA], 4, 8, trace=False)
    ctx = fam.plan([drv_seq(fam)], torch.arange(8))
    q, kv = torch.zeros(8, 2, 32), torch.zeros(8, 32)
    with pytest.raises(ValueError, match="must precede attend"):
        ctx.attend(0, q, kv, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="series must be in"):
        ctx.compress_windows(0, "other", torch.zeros(8, 64), torch.zeros(8, 64))
    ctx.compress_windows(0, "compressor", torch.zeros(8, 64), torch.zeros(8, 64))
    with pytest.raises(ValueError, match="called twice"):
        ctx.compress_windows(0, "compressor", torch.zeros(8, 64), torch.zeros(8, 64))
    with pytest.raises(ValueError, match="entries must have shape"):
        ctx.store_entries(0, "compressor", torch.zeros(3, 32))


def drv_seq(fam):
    from kvplan.backends.hybrid.api import HybridSeq

    return HybridSeq(0, 0, 8, [0] * 8, list(range(1, 7)), 0)


def test_config_mapping() -> None:
    fam, _ = make_family([SLIDING, CSA, HCA], 5, 16, trace=False)
    cfg = fam.config
    assert (cfg.window_size, cfg.swa_block_size, cfg.block_size) == (5, 5, 16)
    assert (cfg.dense_ratios, cfg.sparse_ratios) == ((16,), (4,))
    assert (cfg.max_model_len, cfg.max_num_blocks) == (MAX_LEN, 6)
    assert (cfg.num_kv_blocks, cfg.num_state_slots) == (64, 8)
    with pytest.raises(ValueError, match="disagree on the sliding window"):
        PlannedHybridFamily(
            make_layers([SLIDING], 4, {}) + make_layers([SLIDING], 5, {}),
            block_size=16, num_blocks=4, num_state_slots=2, max_model_len=32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="must divide block_size"):
        PlannedHybridFamily(
            make_layers([HCA], 4, {HCA: 32}), block_size=16, num_blocks=4, num_state_slots=2,
            max_model_len=32,
        )  # fmt: skip


def test_plan_store_rows_are_checked() -> None:
    """``check=True`` refuses metadata whose compressed store rows are not the closing entries."""
    fam, _ = make_family([HCA], 4, 8, trace=False)
    ctx = fam.plan([drv_seq(fam)], torch.arange(8))
    ctx.meta.positions_c["8"][0] = 16
    assert set(ctx._states) == {(8, False)}  # plan() planned the compressor state already
    ctx._states.clear()  # so that the corrupted metadata is planned (and checked) again
    with pytest.raises(AssertionError, match="closing entries"):
        ctx.compress_windows(0, "compressor", torch.zeros(8, 32), torch.zeros(8, 32))
