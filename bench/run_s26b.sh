#!/usr/bin/env bash
# Session 26, call B, after the dense decode's fused merge and decode mode 3 were removed
# (commit 6ccc614):
# 1. GPU tests of the decode kernel's files (its signature changed).
# 2. Long workload (32 x 8,192 x 256), bf16 / fp8 / fp4 side by side (issue 17's ratios,
#    with session 25's prefill commits before the token wait).
# 3. Hybrid end to end against Hugging Face (16 x 4,096 x 128; issue 14's >= 20x).
# 4. Short workload (64 x 256 x 128) against HF's best setting (issue 17's >= 30x).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | head -10
for f in bf16 fp8 fp4; do long_run "long_$f" $f; done
step 160 hybrid_hf python3 bench/bench_hybrid_hf.py --split --out "$W/hybrid_hf.json"
grep -E "tok/s|prefill|decode step|HF" "$W/hybrid_hf.log" | head -12
step 100 short_hf python3 bench/bench_engine.py --kv-format bf16 --hf generate_batch_cuda_graph --out "$W/short_hf.json"
grep -E "tok/s|kvplan \(|HF|generate|decode step" "$W/short_hf.log" | head -12
