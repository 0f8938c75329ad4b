#!/usr/bin/env bash
# Session 33, call B: the indexer's fp16 tiles (raw e4m3 values, scales after the dot).
# GPU tests of the index / sparse kernels; the kernel alone (default = fp16 tiles, f16=False,
# the legacy kernel) at 256 x 32,768 and 32 x 8,192; the decode step with KVPLAN_INDEX_F16=0/1
# at 128K x 256 and 32K x 32 (fp8 records, mxfp8 index keys).
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
gpu_tests idx_tests 100 8 tests/ops/test_sparse_attention.py tests/ops/test_index_scores_seq.py \
  tests/backends/test_hybrid_gpu_kernels.py
for r in 256:32768 32:8192; do
  step 40 k${r%%:*} python3 bench/bench_sparse_kernels.py --only index --rows ${r%%:*} \
    --candidates ${r##*:} --index-kinds mxfp8 --out "$W/k${r%%:*}.json"
  grep -E "index_scores" "$W/k${r%%:*}.log" | head -8
done
for f in 0 1; do
  step 70 d128k_$f env KVPLAN_INDEX_F16=$f python3 bench/bench_hybrid.py --batch 256 \
    --contexts 131072 --formats fp8 --profile 1 --out "$W/d128k_$f.json"
  grep -E "^ *fp8 |async" "$W/d128k_$f.log"
done
for f in 0 1; do
  step 45 d32k_$f env KVPLAN_INDEX_F16=$f python3 bench/bench_hybrid.py --batch 32 \
    --contexts 32768 --formats fp8 --out "$W/d32k_$f.json"
  grep -E "^ *fp8 |async" "$W/d32k_$f.log"
done
