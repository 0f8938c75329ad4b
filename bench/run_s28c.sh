#!/usr/bin/env bash
# Session 28, call C: the host functions of the hybrid workload's eager steps (cProfile,
# 200 rows a step).
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
step 250 steps python3 bench/hybrid_steps.py --profile cprofile --top 200 --small 8 \
  --out "$W/steps.json"
grep -vE "USDT|^\s*$|Writing" "$W/steps.log" | cut -c1-240 | tail -20
