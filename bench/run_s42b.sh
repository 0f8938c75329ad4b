#!/usr/bin/env bash
# Session 42's second call: the fused block norm with hc_pre's one warp (call A's four-warp
# program made the Sinkhorn program slower and the step no faster). Its GPU tests, the 32K x 32
# fp8 decode step off / on alternating six times (KVPLAN_HC_FUSED_NORM), one profile of each,
# then the whole GPU suite in what is left.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 120 14 tests/ops/test_hyper_connection_norm.py tests/ops/test_hyper_connection.py \
  tests/ops/test_hyper_connection_fused.py tests/ops/test_hyper_connection_rows.py \
  tests/ops/test_rms_norm.py tests/models/test_deepseek_v4_blocks.py
for v in 0 1 0 1 0 1 0 1 0 1 0 1; do
  hybrid_decode "d32k_n$v" 32 32768 KVPLAN_HC_FUSED_NORM=$v
done
for v in 0 1; do
  step 45 "p32k_n$v" env KVPLAN_HC_FUSED_NORM=$v python3 bench/bench_hybrid.py --batch 32 \
    --contexts 32768 --formats fp8 --profile 2 --out "$W/p32k_n$v.json"
  grep -E "ALL KERNELS|rms_norm|hc_pre|hc_proj|async" "$W/p32k_n$v.log"
done
gpu_tests suite 340 14 tests
