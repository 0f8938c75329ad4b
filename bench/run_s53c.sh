#!/usr/bin/env bash
# Session 53, call C: the decode step's latency-bound kernels swept on the H200 at the 32K x 32
# decode shapes (session 53's profile: top-k 2 x 13 us, index scores 23 us, split attention
# 20-27 us a layer): the top-k's modes x digit widths (32 rows x 8,232 columns, 8,192
# eligible), the indexer's tiles x warps x stages (32 x 8,192 MXFP8 keys), the split attention's
# splits x tiles x stages.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 120 topk python3 bench/bench_sparse_kernels.py --only topk --rows 32 --candidates 8192 \
  --topk-width 8232 --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-130
step 250 index python3 bench/bench_sparse_kernels.py --only index --rows 32 --candidates 8192 \
  --index-kinds mxfp8 --sweep --sweep-stages --out "$W/index.json"
grep -E "^index" "$W/index.log" | sort -t' ' -k1,1 | cut -c1-130
