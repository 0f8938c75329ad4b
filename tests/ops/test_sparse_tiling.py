"""sparse_attention's register-footprint knobs (``d_chunk``: logits summed over query / key
column chunks; ``pv_split``: the value product on accumulator column chunks): the CPU
interpreter equals the torch path on both the one-program and the split kernels; the
chunked kernels compile for sm_90 within a register bound; on CUDA they equal the whole-tile
kernel bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_sparse_attention import FP4_64, FP8_64, _inputs, _v4_inputs

from kvplan.formats import V41_FORMAT
from kvplan.ops.sparse_attention import sparse_attention_torch, sparse_attention_triton

interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@interpreter
@pytest.mark.parametrize("d_chunk,pv_split", [(16, 1), (32, 2), (0, 4), (16, 4)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunked_interpreter_equals_torch(d_chunk, pv_split, num_splits) -> None:
    """FP8 + FP4 sources (head_dim 64: FP4 scale groups of 16 and 32 wider than a 16-column
    chunk take the per-element scale path); row 0 sees nothing; head 1 has no sink."""
    q, sources, sinks = _inputs([FP8_64, FP4_64], 3, 2, 64, [20, 30], seed=31)
    sources[0].index[0] = -1
    sources[1].index[0] = -1
    sinks[1] = float("-inf")
    got = sparse_attention_triton(q, sources, sinks, 0.125, tile_n=16, num_splits=num_splits,
                                  d_chunk=d_chunk, pv_split=pv_split)  # fmt: skip
    want = sparse_attention_torch(q, sources, sinks, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_knob_errors() -> None:
    q, sources, sinks = _inputs(["fp32"], 2, 2, 64, [4], seed=0)
    with pytest.raises(ValueError, match="d_chunk"):
        sparse_attention_triton(q, sources, sinks, 1.0, d_chunk=24)
    with pytest.raises(ValueError, match="d_chunk"):
        sparse_attention_triton(q, sources, sinks, 1.0, d_chunk=128)
    with pytest.raises(ValueError, match="pv_split"):
        sparse_attention_triton(q, sources, sinks, 1.0, pv_split=3)


_REGS = r"""
import json, sys
sys.path[:0] = ["bench", "."]
try:
    from triton.backends.nvidia.compiler import get_ptxas
    get_ptxas(90)
except Exception as e:
    print("NO_PTXAS", e); sys.exit(0)
import hybrid_kernel_regs as h
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops import _sparse_split_kernels as _ks
out = {}
for name, fn in (("one", _k.sparse_attention_kernel), ("split", _ks.sparse_attention_split_kernel)):
    const = dict(HEAD_DIM=512, D_P2=512, TILE_H=16, TILE_N=16, **h.V41, HAS1=True, HW=True,
                 DOT_BF16=True, INTERPRET=False, D_CHUNK=64, PV_SPLIT=4, F16=False)
    if name == "one":
        const["HALF_RD"] = 32  # the model's out_rope (64 rotary channels)
    else:
        const.update(FUSED=False, HALF_RD=0)
    out[name] = h.report(fn, const, h.ATTN_TYPES, 8, 1)
print(json.dumps(out))
"""


def test_chunked_kernels_compile_for_sm90_without_spills() -> None:
    """DeepSeek-V4 shapes (V41 sources, 16 heads x 512, bf16 dots), d_chunk 64, pv_split 4,
    8 warps, 1 stage: no spills and under 176 registers (the whole-tile kernel needs 204+).
    (d_chunk 128 compiled to 162-166 registers with runtime block sizes; with constexpr block
    sizes ptxas holds it to 128 and spills 64-68 bytes.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _REGS], capture_output=True, text=True,
                          env=env, cwd=_ROOT)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"sm_90 compile failed:\n{proc.stderr[-3000:]}")
    if proc.stdout.startswith("NO_PTXAS"):
        pytest.skip(proc.stdout.strip())
    for name, r in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert r["spill_bytes"] == 0, (name, r)
        assert 0 < r["registers"] < 176, (name, r)


@pytest.mark.gpu
@pytest.mark.parametrize("d_chunk,pv_split", [(64, 1), (64, 4), (128, 4), (32, 2), (0, 4)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_cuda_chunked_equals_whole_tile(d_chunk, pv_split, num_splits) -> None:
    """bf16 queries on V41 sources: the chunked products are the same mma steps in the same
    order, so the outputs equal the whole-tile kernel's bit for bit."""
    q, sources, sinks = _v4_inputs(8, 16, 128, 512, V41_FORMAT, torch.bfloat16, seed=32)
    sources[1].index[:2] = -1
    base = sparse_attention_triton(q, sources, sinks, 512**-0.5, num_splits=num_splits)
    got = sparse_attention_triton(q, sources, sinks, 512**-0.5, num_splits=num_splits,
                                  d_chunk=d_chunk, pv_split=pv_split)  # fmt: skip
    assert torch.equal(got, base)
