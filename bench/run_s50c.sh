#!/usr/bin/env bash
# Session 50, call C (call B cut to the device time left): the default split (o and down in
# 2, 32-128 rows) against none, the short workload end to end alternating, its decode graph
# profiled, then the split path's GPU tests.
set -u
BUDGET=${BUDGET:-250}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for i in 1 2; do
  short_run off$i bf16 KVPLAN_SPLIT_LINEAR=0
  short_run on$i bf16
done
step 40 prof python3 bench/profile_engine.py --replays 20 --steps 5 --out "$W/prof"
grep -E "replay wall|kernel time|nvjet|splitK|rms_norm" "$W/prof.log" | head -8
gpu_tests split $(( $(left) - 3 )) 14 tests/models/test_split_linear.py tests/models/test_fused_gpu.py
