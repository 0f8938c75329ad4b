#!/usr/bin/env bash
# Session 16, call B: prepared, NOT run (the session's device time ran out). The final form of
# the searched fp8 / fp4 scales (int32, K only): bit-exactness on the GPU, then the dense decode step
# fp8 with and without the search (KVPLAN_KV_SCALE_SEARCH) and bf16, side by side in one run
# (call A: the first form 1.538 ms, bf16 1.412 ms; session 15: fp8 amax / 448 1.408 ms).
set -u
BUDGET=${BUDGET:-440}
source bench/gpu_steps.sh
step 130 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_store.py tests/models/test_fused_gpu.py tests/cache/test_kv_tensors.py \
  tests/ops/test_read_slots.py tests/engine/test_quantized_kv_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 60 store python3 bench/bench_store_load.py --formats ENGINE_FP8x512 FP8_AMAX_x512 ENGINE_FP4x512 FP4_PLAIN_x512 --tokens 256 4096 65536 --out "$W/store.json"
grep -E "store" "$W/store.log" | head -24
step 45 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 45 short_fp8_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_plain.log"
step 45 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
grep -E "kvplan \(|decode step" "$W/short_bf16.log"
step 45 short_fp4 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4.json"
grep -E "kvplan \(|decode step" "$W/short_fp4.log"
step 45 short_fp4_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp4_plain.log"
