#!/usr/bin/env bash
# Session 18, call C: `small_linear` on the LM heads only (call B: slower than cuBLAS on the
# narrow decode GEMMs, and split K slower still): GPU tests, the head sweep, the engines with it
# on / off, and a profile of the dense decode step with a bf16 and an fp8 cache.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 100 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_small_gemm.py tests/engine tests/models
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 90 sweep python3 bench/bench_small_gemm.py --out "$W/sweep.json"
grep -vE "^\s*$" "$W/sweep.log" | head -30
for f in bf16 fp8; do
  step 45 short_${f}_on python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_${f}_on.json"
  grep -E "kvplan \(|decode step" "$W/short_${f}_on.log"
  step 45 short_${f}_off env KVPLAN_SMALL_GEMM=0 python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_${f}_off.json"
  grep -E "kvplan \(|decode step" "$W/short_${f}_off.log"
done
step 50 prof_bf16 python3 bench/profile_engine.py --out "$W" --steps 10
head -30 "$W/prof_bf16.log"
step 50 prof_fp8 python3 bench/profile_engine.py --out "$W" --steps 10 --kv-format fp8
head -30 "$W/prof_fp8.log"
