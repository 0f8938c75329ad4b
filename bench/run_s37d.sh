#!/usr/bin/env bash
# Session 37, call D: two KV heads a program for the other quantized formats, and the fp8
# bound. 1. int8 / fp4 at 32 x 8K, one and two heads over tilings (32 | 64 keys, 2 warps,
# 2 | 3 stages); 2. fp8 / int8 at 64 x 2K, one head (default) vs two (their tiling);
# 3. the long workload with int8 pages: default (one head) vs KVPLAN_DECODE_HEADS=2.
set -u
BUDGET=${BUDGET:-250}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 70 qd_8k python3 bench/bench_quant_decode.py --graph --splits "" --batch 32 --context 8192 \
  --tiles 32,64 --warps 2 --stages 2,3 --heads 2 --formats int8,fp4 --out "$W/qd_8k.json"
grep -E "^ +(int8|fp4) " "$W/qd_8k.log" | head -30
step 30 qd_2k python3 bench/bench_quant_decode.py --graph --splits "" --batch 64 --context 2048 \
  --no-tiling --heads 2 --formats fp8,int8 --out "$W/qd_2k.json"
grep -E "^ +(fp8|int8) " "$W/qd_2k.log" | head -10
long_run long_int8_h1 int8
long_run long_int8_h2 int8 KVPLAN_DECODE_HEADS=2
