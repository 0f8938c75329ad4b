"""PlannedHybridFamily's in-place attention path (``kvplan.ops.sparse_attention`` reading the
ring and the compressor pool through slot tables) equals the per-token oracle: on CPU with the
path forced (torch gather and, on a short schedule, the Triton kernel in the interpreter), and
on CUDA where it is the default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_oracle import Driver
from test_hybrid_planned import CSA, HCA, SLIDING, make_family, schedules

from kvplan.backends.hybrid import planned_step
from kvplan.ops import sparse_attention as sa


def _run(fam, oracle, steps, tol):
    drv = Driver(fam, oracle, seed=13, atol=tol, rtol=tol)
    for step in steps:
        drv.step([drv.seq(e[0], e[1], e[2], bool(e[3]) if len(e) > 3 else False) for e in step])


@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
@pytest.mark.parametrize("name", ["mixed", "restart"])
def test_in_place_path_cpu(monkeypatch, kv_format: str, name: str) -> None:
    """The index-table path (``KVPLAN_PROMPT_RANGES=0``; the range path loads every pool into
    rows for its prompt rows, `test_prompt_range_path_in_the_family_equals_oracle`)."""
    monkeypatch.setenv("KVPLAN_PROMPT_RANGES", "0")
    monkeypatch.setattr(planned_step, "in_place", lambda q: True)
    calls = []
    original = planned_step.sparse_attention

    def spy(q, sources, *a, **k):
        pools = {c.pools["compressor"].cache.data_ptr() for c in fam.caches
                 if "compressor" in c.pools}  # fmt: skip
        calls.append([(s.cache.dtype, s.cache.data_ptr() in pools) for s in sources])
        return original(q, sources, *a, **k)

    monkeypatch.setattr(planned_step, "sparse_attention", spy)
    rng = np.random.default_rng(5)
    fam, oracle = make_family([SLIDING, CSA, HCA], 5, 8, kv_format=kv_format, trace=False)
    _run(fam, oracle, schedules(rng)[name], 1e-5 if kv_format == "exact" else 2e-5)
    assert len(calls) > 10
    # decode rows read the compressed entries in place from their pool (uint8 records when
    # quantized); prompt rows too from an exact pool, from rows dequantized once otherwise
    compressed = [c[1] for c in calls if len(c) == 2]
    in_pool = [d for d, pooled in compressed if pooled]
    assert in_pool and len({d for d, _ in compressed}) == (1 if kv_format == "exact" else 2)
    if kv_format == "exact":
        assert len(in_pool) == len(compressed)
    else:
        assert all(d == torch.uint8 for d in in_pool)
        assert all(d == torch.float32 for d, pooled in compressed if not pooled)


def test_in_place_path_triton_interpreter(monkeypatch) -> None:
    """The CUDA path's kernels (sparse attention, indexer scores, top-k) in the CPU
    interpreter inside the family, fp8 caches, prefill chunks and decode rows."""
    monkeypatch.setattr(planned_step, "in_place", lambda q: True)
    monkeypatch.setattr(planned_step, "sparse_attention", sa.sparse_attention_triton)

    def forced(fn):
        def run(*a, **k):
            with pytest.MonkeyPatch.context() as m:
                m.setenv("KVPLAN_FORCE_TRITON", "1")
                return fn(*a, **k)

        return run

    monkeypatch.setattr(planned_step, "index_scores", forced(sa.index_scores))
    monkeypatch.setattr(planned_step, "topk_columns", forced(sa.topk_columns))
    fam, oracle = make_family([CSA, HCA], 4, 8, kv_format="fp8", trace=False, top_k=3)
    steps = [[(0, 0, 9)], [(0, 9, 1)], [(0, 10, 3), (1, 0, 5)], [(0, 13, 1), (1, 5, 1)]]
    _run(fam, oracle, steps, 2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["exact", "fp8", "fp4"])
@pytest.mark.parametrize("name", ["chunked", "mixed", "restart", "decode"])
def test_in_place_path_cuda(kv_format: str, name: str) -> None:
    rng = np.random.default_rng(3)
    fam, oracle = make_family([SLIDING, CSA, HCA], 5, 8, kv_format=kv_format, device="cuda",
                              decode_builder="auto", trace=False)  # fmt: skip
    _run(fam, oracle, schedules(rng)[name], 2e-5)
