#!/usr/bin/env bash
# Prepared in session 35 for the next session's first call: e4m3 / UE8M0 keys dequantized by
# bf16 products (KVPLAN_SPARSE_BF16_DEQUANT=1: the same bits, 6 % fewer main-loop
# instructions in the split attention, 5 % in the indexer on sm_90), off against on.
# 1. GPU tests of the sparse kernels and the indexer with it on;
# 2. the kernels alone at 256 rows (attention: 128 + 512 / 1,024 keys; index: 32,768 keys);
# 3. the DeepSeek-V4-shaped decode step at 128K x 256 and 32K x 32.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
KVPLAN_SPARSE_BF16_DEQUANT=1 gpu_tests bd_tests 100 8 tests/ops/test_sparse_attention.py \
  tests/ops/test_sparse_split.py tests/ops/test_index_scores_seq.py
for v in 0 1; do
  step 70 att_v$v env KVPLAN_SPARSE_BF16_DEQUANT=$v python3 bench/bench_sparse_kernels.py \
    --only attention --no-chunked --rows 256 --hca-entries 1024 --out "$W/att_v$v.json"
  grep -E "^sparse_attention" "$W/att_v$v.log" | cut -c1-150
  step 60 idx_v$v env KVPLAN_SPARSE_BF16_DEQUANT=$v python3 bench/bench_sparse_kernels.py \
    --only index --rows 256 --candidates 32768 --index-kinds mxfp8 --out "$W/idx_v$v.json"
  grep -E "^index_scores" "$W/idx_v$v.log" | cut -c1-150
done
for v in 0 1; do HD_SECS=80 hybrid_decode d128_v$v 256 131072 KVPLAN_SPARSE_BF16_DEQUANT=$v; done
