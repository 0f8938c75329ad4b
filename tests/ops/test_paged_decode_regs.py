"""Register budget of the dense paged decode kernel over quantized pages, compiled for sm_90.

The quantized specializations dequantize K/V tiles in registers; a register count above 128 per
thread (4 warps) leaves fewer than 4 programs per H200 SM, and spills put the tiles in local
memory. Compiled in a fresh process without ``TRITON_INTERPRET`` (see ``tests/sm90_compile.py``)
with the launch's integer specialization: pointers and the engine's strides divisible by 16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import json, subprocess, sys, tempfile
from pathlib import Path
try:
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
except Exception as e:  # no CUDA toolchain in this Triton install
    print("NO_PTXAS", e)
    sys.exit(0)
from kvplan.ops._paged_attention_kernels import _decode_kernel as fn
from tools.compile_sm90 import compile_kernel

kv_quant, sf_kind, group, tile_n, warps, stages = json.loads(sys.argv[1])
const = dict(TILE_M=16, BLOCK_SIZE=16, TILE_N=tile_n, HEAD_DIM=64, DOT_PRECISION="tf32",
             SPLIT=True, INTERPRET=False, KV_QUANT=kv_quant, SF_KIND=sf_kind, GROUP=group)
div16 = {n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride")
         or n in ("num_splits", "sf_off")}
def arg_type(n):
    if n in const:
        return "constexpr"
    if n in ("k_ptr", "v_ptr"):
        return "*u8"
    if n in ("q_ptr", "out_ptr"):
        return "*bf16"
    if n.endswith("_ptr"):
        return "*fp32" if n.startswith("part") else "*i32"
    return "fp32" if n == "qk_scale" else "i32"
sig = {n: arg_type(n) for n in fn.arg_names}
attrs = {(i,): [("tt.divisibility", 16)] for i, n in enumerate(fn.arg_names) if n in div16}
ck = compile_kernel(fn, sig, const, attrs, {"num_warps": warps, "num_stages": stages})
with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / "k.ptx"
    src.write_text(ck.asm["ptx"])
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(src) + ".o"],
                         capture_output=True, text=True, check=True)
regs = spills = None
for line in res.stderr.splitlines():
    if "registers" in line:
        regs = int(line.split("Used ")[1].split(" reg")[0])
    if "spill stores" in line:
        spills = int(line.split("bytes spill stores")[0].split(",")[-1])
print("RESULT", json.dumps([regs, spills]))
"""


def _registers(spec) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=_ROOT, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"sm_90 compile failed:\n{proc.stderr[-3000:]}")
    if proc.stdout.startswith("NO_PTXAS"):
        pytest.skip(f"no ptxas: {proc.stdout.strip()}")
    regs, spills = json.loads(proc.stdout.rsplit("RESULT", 1)[1])
    return regs, spills


# (format, (KV_QUANT, SF_KIND, GROUP), register bound) at the default decode tiling (64 keys,
# 4 warps, 2 stages): the engine's fp8 (e4m3, fp32 scales per 32) and fp4 (e2m1, e4m3 per 16);
# the bound keeps 4 programs an SM (a bf16-multiply fp4 variant held 96 but ran slower)
BUDGETS = [("fp8", (1, 2, 32), 128), ("fp4", (2, 1, 16), 128)]


@pytest.mark.parametrize("name,consts,bound", BUDGETS)
def test_quantized_decode_fits_register_budget_on_sm90(name, consts, bound):
    from kvplan.ops._paged_kv_tiles import DECODE_TILING

    dtype = {"fp8": "e4m3", "fp4": "e2m1"}[name]
    regs, spills = _registers([*consts, *DECODE_TILING[dtype]])
    assert spills == 0, f"{name} decode spills {spills} bytes"
    assert 0 < regs <= bound, f"{name} decode uses {regs} registers per thread (bound {bound})"
