#!/usr/bin/env bash
# Session 54, call E (the last of its device time): two small changes, each a switch, in
# profiled 32K x 32 fp8 decode steps (per-kernel sums, one machine): hc_proj_kernel's fn load
# issued first (KVPLAN_HC_FN_FIRST=1) and the indexer's scores in tiles of 64 keys
# (KVPLAN_INDEX_TILE_N=64), against the defaults; the first step compiles on a cold machine.
set -u
BUDGET=${BUDGET:-230}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 80 p0 python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 --profile 2 \
  --out "$W/p0.json"
grep -E "ALL KERNELS|async|hc_proj|index_scores" "$W/p0.log"
profile_32k p1 "hc_proj|index_scores|ALL" KVPLAN_HC_FN_FIRST=1 KVPLAN_INDEX_TILE_N=64
profile_32k p2 "hc_proj|index_scores|ALL"
profile_32k p3 "hc_proj|index_scores|ALL" KVPLAN_HC_FN_FIRST=1 KVPLAN_INDEX_TILE_N=64
