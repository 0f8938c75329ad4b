#!/usr/bin/env bash
# Session 26, last call: the whole GPU suite at the session's final code (session 25's engine
# and tensor-parallel changes had not run on the GPU), then the hybrid decode step at 32K /
# 128K, batch 32, fp8 records vs bf16 rows (issue 14's figures), as far as the budget goes.
set -u
BUDGET=${BUDGET:-360}
source bench/gpu_steps.sh
step 290 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12
step 90 hybrid_decode python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --out "$W/hybrid_decode.json"
grep -vE "Warning|warn" "$W/hybrid_decode.log" | tail -14
