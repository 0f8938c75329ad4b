#!/usr/bin/env bash
# For session 43's first call: the whole GPU suite with the fused block norms on by default
# (session 42's suite ran at a commit where KVPLAN_HC_FUSED_NORM was still off; only the
# norm's own GPU tests and the benchmark steps ran it on), then the 32K x 32 fp8 decode step
# with the norms fused and apart, alternating, on whatever card is lent.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 340 14 tests
for v in 1 0 1 0 1 0; do
  hybrid_decode "d32k_n$v" 32 32768 KVPLAN_HC_FUSED_NORM=$v
done
