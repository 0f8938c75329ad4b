#!/usr/bin/env bash
# Session 16, call B (the last 4 minutes of device time): the cheaper K-only searched fp8 store,
# bit-exactness on the GPU, then the dense decode step fp8 vs bf16 (call A: fp8 1.538 ms with
# the first form, bf16 1.412 ms).
set -u
BUDGET=${BUDGET:-150}
source bench/gpu_steps.sh
step 45 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 60 gpu_tests python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_store.py tests/models/test_fused_gpu.py tests/cache/test_kv_tensors.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 45 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
grep -E "kvplan \(|decode step" "$W/short_bf16.log"
