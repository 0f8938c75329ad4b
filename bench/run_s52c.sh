#!/usr/bin/env bash
# Session 52, call C (the last device minutes): the LM-head argmax GPU test whose setup was
# fixed after call A, then the hybrid bench with the decode graph's tokens (as the engine
# takes them) against argmax_rows after the replay, 32K x 32 fp8, alternating.
set -u
BUDGET=${BUDGET:-170}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 45 4 tests/ops/test_small_gemm_argmax.py
for r in a b c; do
  for v in 1 0; do hybrid_decode ga$v$r 32 32768 KVPLAN_GRAPH_ARGMAX=$v; done
done
