#!/usr/bin/env bash
# Session 39, call D: the whole GPU suite on the session's final code (context tiers for the
# DeepSeek-V4 decode graphs, the top-k's parts of 4,096 columns), then the top-k alone at 32
# rows of 16,384 columns (the new default, parts of 4,096, against the whole row).
set -u
BUDGET=${BUDGET:-450}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 330 14 tests
step 80 topk python3 bench/bench_sparse_kernels.py --only topk --rows 32 --candidates 16384 \
  --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-140
