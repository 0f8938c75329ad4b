#!/usr/bin/env bash
# Session 17, call A: session 16's searched scales on the GPU (bit-exactness, store cost, the
# dense decode step with and without the search, bf16 beside them), and the V41 keys
# dequantized in packed bf16 (`e4m3_ue8m0_bf16`) vs the fp32 product (KVPLAN_BF16_DEQUANT=0)
# in the hybrid decode step; the fp8 prefill over the values the fused store returns
# (stored_values) vs the backend's store (KVPLAN_FUSED_KV_STORE=0: the paged prefill kernel).
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 170 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/test_quant.py tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py \
  tests/ops/test_store.py tests/models/test_fused_gpu.py tests/cache/test_kv_tensors.py \
  tests/ops/test_read_slots.py tests/engine/test_quantized_kv_engine.py tests/engine/test_hybrid_graphs.py \
  tests/backends/test_fresh_prefill_gpu.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 50 store python3 bench/bench_store_load.py --formats ENGINE_FP8x512 FP8_AMAX_x512 ENGINE_FP4x512 FP4_PLAIN_x512 --tokens 256 4096 65536 --out "$W/store.json"
grep -E "store" "$W/store.log" | head -24
step 45 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 45 short_fp8_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_plain.log"
step 45 short_fp8_nostore env KVPLAN_FUSED_KV_STORE=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_nostore.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_nostore.log"
step 45 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
grep -E "kvplan \(|decode step" "$W/short_bf16.log"
step 70 hyb_on python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_on.json"
grep -E "fp8 |async" "$W/hyb_on.log"
step 70 hyb_off env KVPLAN_BF16_DEQUANT=0 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_off.json"
grep -E "fp8 |async" "$W/hyb_off.log"
step 60 idx_on python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --only index --index-kinds mxfp8 --out "$W/idx_on.json"
grep -E "index" "$W/idx_on.log" | head -4
step 60 idx_off env KVPLAN_BF16_DEQUANT=0 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --only index --index-kinds mxfp8 --out "$W/idx_off.json"
grep -E "index" "$W/idx_off.log" | head -4
