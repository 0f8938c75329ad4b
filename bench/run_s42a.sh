#!/usr/bin/env bash
# Session 42's first call: the block input norms fused into the hyper-connections
# (`hc_pre(..., norm=)`: 25 fewer launches a DeepSeek-V4 decode step). The GPU tests of the
# changed kernels and of the DeepSeek-V4 engine paths first, then the 32K x 32 fp8 decode step
# with the fusion off / on, alternating (KVPLAN_HC_FUSED_NORM), then one profile of each.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 200 14 tests/ops/test_hyper_connection_norm.py tests/ops/test_hyper_connection.py \
  tests/ops/test_hyper_connection_fused.py tests/ops/test_hyper_connection_rows.py \
  tests/ops/test_rms_norm.py tests/models tests/engine/test_hybrid_graphs.py \
  tests/engine/test_hybrid_async.py tests/engine/test_deepseek_v4_engine.py
for v in 0 1 0 1; do
  hybrid_decode "d32k_n$v" 32 32768 KVPLAN_HC_FUSED_NORM=$v
done
for v in 0 1; do
  step 45 "p32k_n$v" env KVPLAN_HC_FUSED_NORM=$v python3 bench/bench_hybrid.py --batch 32 \
    --contexts 32768 --formats fp8 --profile 2 --out "$W/p32k_n$v.json"
  grep -E "ALL KERNELS|rms_norm|hc_pre|hc_proj|async" "$W/p32k_n$v.log"
done
