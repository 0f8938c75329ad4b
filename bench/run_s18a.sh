#!/usr/bin/env bash
# Session 18, call A: the whole GPU test suite, then what session 17 prepared as call E (never run
# there; its script folded in here): 16-row hc
# projection tiles at larger decode batches too (KVPLAN_HC_SMALL_ROWS=256) vs the default
# (16-row tiles up to 32 rows, 32-row above): batch 64 at 32K and batch 256 at 128K, fp8.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 300 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
step 40 b64_default python3 bench/bench_hybrid.py --contexts 32768 --batch 64 --formats fp8 --out "$W/b64_default.json"
grep -E "fp8 |async" "$W/b64_default.log"
step 40 b64_small env KVPLAN_HC_SMALL_ROWS=256 python3 bench/bench_hybrid.py --contexts 32768 --batch 64 --formats fp8 --out "$W/b64_small.json"
grep -E "fp8 |async" "$W/b64_small.log"
step 70 b256_default python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8 --out "$W/b256_default.json"
grep -E "fp8 |async" "$W/b256_default.log"
step 70 b256_small env KVPLAN_HC_SMALL_ROWS=256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8 --out "$W/b256_small.json"
grep -E "fp8 |async" "$W/b256_small.log"
