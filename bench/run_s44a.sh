#!/usr/bin/env bash
# Ran at commit 2a3dacd; the kernels and bench_moe_decode.py were removed after it (bench/RESULTS.md).
# Session 44, call A: a decode step's dense MoE in two Triton kernels (`kvplan.ops.moe_decode`:
# the SwiGLU in the gate/up GEMM's epilogue, the weighted expert sum in the down GEMM's):
# their GPU tests and the DeepSeek-V4 MoE / model / engine GPU tests, the kernels alone
# against cuBLAS (`bench_moe_decode.py`), then the 32K x 32 fp8 decode step with
# KVPLAN_MOE_DECODE 1 / 0 alternating, and one profiled step.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ops 150 8 tests/ops/test_moe_decode.py tests/ops/test_moe_dense.py tests/ops/test_moe_grouped.py \
  tests/models/test_deepseek_v4_*.py tests/engine/test_deepseek_v4_engine.py
step 70 moe python3 bench/bench_moe_decode.py --rows 16,32,64 --out "$W/moe.json"
grep -E "^T=|plan" "$W/moe.log"
decode_ab KVPLAN_MOE_DECODE d32k_m 1 0 1 0 1 0
profile_32k p32k "moe_|nvjet|swiglu|expert_sum|splitK"
