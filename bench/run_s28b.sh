#!/usr/bin/env bash
# Session 28, call B: the hybrid workload step by step (what the small eager mixed step costs
# and why), and the decode step's kernels at the workload's shape (batch 16, 4K).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 300 steps python3 bench/hybrid_steps.py --out "$W/steps.json"
grep -vE "USDT|^\s*$|Writing" "$W/steps.log" | cut -c1-240 | tail -40
step 150 dec16 python3 bench/bench_hybrid.py --batch 16 --contexts 4096 --formats fp8 \
  --profile 2 --out "$W/dec16.json"
grep -vE "^\s*$" "$W/dec16.log" | cut -c1-200 | tail -30
