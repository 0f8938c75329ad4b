#!/usr/bin/env bash
# Session 27, call C: the range kernel with tensor-descriptor (TMA) key tiles. GPU tests of
# the ranges, index tables vs ranges (TMA and pointer loads) with a tiling sweep, then the
# hybrid workload (16 x 4,096 x 128, prompts alone too) with the index tables first (its
# run compiles the model's kernels on this fresh machine: call A's first run did not finish
# in 80 s for that reason) and the ranges second.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 100 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_sparse_ranges.py tests/backends/test_hybrid_planned_formats.py
tail -3 "$W/gpu_tests.log"
step 200 ranges python3 bench/bench_prompt_ranges.py --sweep --out "$W/ranges.json"
grep -vE "^\s*$" "$W/ranges.log" | cut -c1-700
for r in 0 1; do
  step 130 "e2e_r$r" env KVPLAN_PROMPT_RANGES=$r python3 bench/bench_hybrid_hf.py --split --no-hf \
    --kv-formats fp8 --out "$W/e2e_r$r.json"
  grep -E "kvplan " "$W/e2e_r$r.log" | tail -3
done
