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
decode_ab KVPLAN_HC_FUSED_NORM d32k_n 0 1 0 1 0 1 0 1 0 1 0 1
for v in 0 1; do
  profile_32k "p32k_n$v" "rms_norm|hc_pre|hc_proj" KVPLAN_HC_FUSED_NORM=$v
done
gpu_tests suite 340 14 tests
