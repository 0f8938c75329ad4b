#!/usr/bin/env bash
# Session 14, call D: GPU tests after the last defaults (argmax parts 4 an SM, fused hc
# residual update up to 32 rows), the argmax at its new default, the hybrid decode at batch
# 32 (32K / 128K) and batch 256 (128K), fp8 against bf16 rows.
set -u
BUDGET=${BUDGET:-400}
source bench/gpu_steps.sh
step 90 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_argmax.py tests/ops/test_hyper_connection.py tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_graphs.py tests/engine/test_hybrid_async.py tests/models
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 30 argmax python3 bench/bench_argmax.py --out "$W/argmax.json"
grep -v Warn "$W/argmax.log"
step 130 hybrid32 python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --out "$W/hybrid32.json"
grep -E "^ +(fp8|exact) |async" "$W/hybrid32.log"
step 120 hybrid256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --out "$W/hybrid256.json"
grep -E "^ +(fp8|exact) |async" "$W/hybrid256.log"
