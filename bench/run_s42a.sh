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
decode_ab KVPLAN_HC_FUSED_NORM d32k_n 0 1 0 1
for v in 0 1; do
  profile_32k "p32k_n$v" "rms_norm|hc_pre|hc_proj" KVPLAN_HC_FUSED_NORM=$v
done
