#!/usr/bin/env bash
# Session 27, call A: the prompt range kernel (kvplan.ops.sparse_ranges). Its GPU tests and the
# GPU tests touched since session 26 (penalties, sparse attention, the hybrid family), then
# index tables vs ranges at the DeepSeek-V4 prompt shapes with a tiling sweep, then the hybrid
# workload's kvplan runs (16 x 4,096 x 128, prompts alone too) with ranges on and off.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 150 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_sparse_ranges.py tests/ops/test_sparse_attention.py tests/engine/test_penalties.py \
  tests/backends/test_hybrid_gpu_kernels.py tests/backends/test_hybrid_planned_formats.py
tail -5 "$W/gpu_tests.log"
step 200 ranges python3 bench/bench_prompt_ranges.py --sweep --out "$W/ranges.json"
grep -vE "^\s*$" "$W/ranges.log" | cut -c1-600
for r in 1 0; do
  step 80 "e2e_r$r" env KVPLAN_PROMPT_RANGES=$r python3 bench/bench_hybrid_hf.py --split --no-hf \
    --kv-formats fp8 --out "$W/e2e_r$r.json"
  grep -iE "tok/s|prefill|seconds" "$W/e2e_r$r.log" | tail -6
done
