#!/usr/bin/env bash
# Session 17, call C: the hc projection's 16-row tiles at 32 rows (the default now) vs the
# former 32-row tiles (KVPLAN_HC_SMALL_ROWS=16) inside the hybrid decode step (batch 32),
# fp8 and bf16 rows, side by side; the GPU tests of the hyper-connection ops and the
# DeepSeek-V4 engine first.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
step 80 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_hyper_connection.py tests/engine/test_deepseek_v4_engine.py tests/models/test_deepseek_v4_blocks.py tests/models/test_deepseek_v4_model.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 50 hyb_new python3 bench/bench_hybrid.py --contexts 32768 --formats fp8,exact --out "$W/hyb_new.json"
grep -E "(fp8|exact) |async" "$W/hyb_new.log"
step 50 hyb_old env KVPLAN_HC_SMALL_ROWS=16 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8,exact --out "$W/hyb_old.json"
grep -E "(fp8|exact) |async" "$W/hyb_old.log"
step 50 hyb_new2 python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --out "$W/hyb_new2.json"
grep -E "(fp8|exact) |async" "$W/hyb_new2.log"
step 45 hc_rows python3 bench/bench_dsv4_blocks.py --rows 32 --hc-rows 32 --out "$W/hc_rows.json"
grep -E "hc_post_pre|hc_pre@" "$W/hc_rows.log"
