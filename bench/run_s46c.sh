#!/usr/bin/env bash
# (Ran as call C at 9e5fe89 with BUDGET=380; the switches it sets were removed after it: see
# bench/RESULTS.md, session 46.)
# Session 46, call C (calls A and B in one, speed only; the device time left after failed
# starts allows one call): fp8 pages as fp16 tiles in the dense decode kernel
# (KVPLAN_FP8_F16_KEYS) and V41 fp8 records as fp16 rows in the sparse attention
# (KVPLAN_SPARSE_FP8_F16_ROWS), each off / on: the kernels alone, then the long dense workload
# and the DeepSeek-V4-shaped decode step at 32K x 32.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 80 q8k python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --splits "" \
  --fp8-f16 --heads 2 --out "$W/q8k.json"
grep -E "^ +fp8 " "$W/q8k.log"
for f in 0 1; do sparse_kernels "k256_$f" 256 1024 KVPLAN_SPARSE_FP8_F16_ROWS=$f; done
for f in 0 1 2; do long_run "l$f" fp8 KVPLAN_FP8_F16_KEYS=$f; done
for f in 0 1; do hybrid_decode "d32k_$f" 32 32768 KVPLAN_SPARSE_FP8_F16_ROWS=$f; done
step 50 q320 python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --splits "" \
  --fp8-f16 --batch 64 --context 320 --out "$W/q320.json"
grep -E "^ +fp8 " "$W/q320.log"
