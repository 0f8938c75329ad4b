"""Register budget of the dense paged decode kernel over quantized pages, compiled for sm_90.

The quantized specializations dequantize K/V tiles in registers; more than 16,384 registers a
program (128 a thread at 4 warps, 256 at 2) leaves fewer than 4 programs per H200 SM, and
spills put the tiles in local memory. Compiled in a fresh process without ``TRITON_INTERPRET`` (see ``tests/sm90_compile.py``)
with the launch's integer specialization: pointers and the engine's strides divisible by 16.
"""

from __future__ import annotations

import pytest

from kvplan.ops._paged_attention_kernels import _decode_kernel
from tests.sm90_compile import kernel_arg_names, sm90_stats


def _registers(spec) -> tuple[int, int]:
    kv_quant, sf_kind, group, tile_n, warps, stages = spec
    const = dict(TILE_M=16, BLOCK_SIZE=16, TILE_N=tile_n, HEAD_DIM=64, DOT_PRECISION="tf32",
                 SPLIT=True, INTERPRET=False, KV_QUANT=kv_quant, SF_KIND=sf_kind, GROUP=group,
                 PREFETCH=False, HEADS_FIRST=False, HEADS=1, RING=0)  # fmt: skip
    names = kernel_arg_names(_decode_kernel)
    sig = {"k_ptr": "*u8", "v_ptr": "*u8", "q_ptr": "*bf16", "out_ptr": "*bf16",
           "qk_scale": "fp32"}  # fmt: skip
    sig.update({n: "*fp32" for n in names if n.startswith("part") and n.endswith("_ptr")})
    div16 = {n for n in names if n.endswith("_ptr") or n.startswith("stride")
             or n in ("num_splits", "sf_off")}  # fmt: skip
    st = sm90_stats(_decode_kernel, const, signature=sig, div16=div16, num_warps=warps,
                    num_stages=stages)  # fmt: skip
    return st.registers, st.spill_bytes


# (format, (KV_QUANT, SF_KIND, GROUP), register bound) at the default decode tiling (64 keys;
# fp8 2 warps, 3 stages; fp4 4 warps, 2 stages): the engine's fp8 (e4m3, fp32 scales per 32) and fp4 (e2m1, e4m3 per 16);
# the bound, registers a program (per thread x threads), keeps 4 programs an SM (a bf16-multiply
# fp4 variant held 96 a thread at 4 warps but ran slower)
BUDGETS = [
    ("fp8", (1, 2, 32), 16384),
    ("fp4", (2, 1, 16), 16384),
    ("fp4_f16", (4, 1, 16), 16384),
]  # fp4 pages as fp16 tiles (KVPLAN_FP4_F16)


@pytest.mark.parametrize("name,consts,bound", BUDGETS)
def test_quantized_decode_fits_register_budget_on_sm90(name, consts, bound):
    from kvplan.ops._paged_kv_tiles import DECODE_TILING

    dtype = {"fp8": "e4m3", "fp4": "e2m1", "fp4_f16": "e2m1"}[name]
    tiling = DECODE_TILING[dtype]
    regs, spills = _registers([*consts, *tiling])
    assert spills == 0, f"{name} decode spills {spills} bytes"
    per_program = regs * 32 * tiling[1]
    assert 0 < per_program <= bound, (
        f"{name} decode uses {regs} registers a thread, {per_program} a program (bound {bound})"
    )
