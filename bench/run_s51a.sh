#!/usr/bin/env bash
# Session 51, call A (session 50's call C, never run, plus the whole GPU suite): the default
# split (o and down in 2, 32-128 rows) against none on the short workload end to end,
# alternating; its decode graph profiled; then every GPU test with the split on by default.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
for i in 1 2; do
  short_run off$i bf16 KVPLAN_SPLIT_LINEAR=0
  short_run on$i bf16
done
step 40 prof python3 bench/profile_engine.py --replays 20 --steps 5 --out "$W/prof"
grep -E "replay wall|kernel time|nvjet|splitK|rms_norm" "$W/prof.log" | head -8
gpu_tests suite $(( $(left) - 5 )) 14 tests
