#!/usr/bin/env bash
# Session 16, call A (the session's only device call: 9.5 minutes of device time were left):
# GPU tests of the searched fp8 scales (store kernel, fused qkv-epilogue store, caches, quant,
# the quantized paged / SDPA readers), the store kernel searched vs amax / 448 side by side,
# then the dense engine's short workload bf16 / fp8 (decode step with the searched fused store).
set -u
BUDGET=${BUDGET:-265}
source bench/gpu_steps.sh
step 105 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_store.py tests/models/test_fused_gpu.py tests/cache tests/test_quant.py \
  tests/ops/test_paged_attention_quantized.py tests/backends/test_sdpa_prefill.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 40 store python3 bench/bench_store_load.py --formats ENGINE_FP8x512 FP8_AMAX_x512 --tokens 64 4096 65536 --out "$W/store.json"
grep -E "store" "$W/store.log" | head -12
step 45 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 45 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
grep -E "kvplan \(|decode step" "$W/short_bf16.log"
