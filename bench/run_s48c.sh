#!/usr/bin/env bash
# Session 48, call C (the device time left): one bf16 decode tiling for every context? Session
# 45 measured (64 keys, 4 warps, 3 stages) 5 % faster than the default (64, 2, 5) in the short
# workload's decode graph, three times out of three, but never at long contexts. The kernel
# alone at 64 x 320, 64 x 2K and 32 x 8K for both, then the short and long bf16 workloads with
# KVPLAN_DECODE_TILING=64,4,3 against the default, alternating.
set -u
BUDGET=${BUDGET:-290}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for shape in "64 320" "64 2048" "32 8192"; do
  set -- $shape
  step 30 "q$1x$2" python3 bench/bench_quant_decode.py --graph --formats bf16 --batch "$1" \
    --context "$2" --tiles 64 --warps 2,4 --stages 3,5 --splits "" --out "$W/q$1x$2.json"
  grep -E " us$" "$W/q$1x$2.log"
done
T=(KVPLAN_DECODE_TILING=64,4,3)
short_run s_d1 bf16
short_run s_t1 bf16 "${T[@]}"
short_run s_d2 bf16
short_run s_t2 bf16 "${T[@]}"
LONG_SECS=50 long_run l_d bf16
LONG_SECS=50 long_run l_t bf16 "${T[@]}"
