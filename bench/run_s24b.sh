#!/usr/bin/env bash
# Session 24, call B: where fp4 loses to fp8 on the long workload (32 x 8,192 x 256), with
# nibble-order tiles now the default.
# 1. Every kernel of the whole workload, fp8 and fp4 (profile_prefill.py --workload).
# 2. fp4 decode tilings at 32 x 8K (the nibble tiles hold fewer registers than the tiles the
#    (64, 2, 2) default was chosen with), fp8 default beside.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
step 150 prof_long python3 bench/profile_prefill.py --workload 32,256 --variants fp8,fp4 --top 30 --out "$W/prof_long.json"
grep -vE "Warning|warn" "$W/prof_long.log" | head -90
step 150 fp4_tiling python3 bench/bench_quant_decode.py --graph --formats fp4,fp8 --tiles 32,64,128 --warps 2,4 --stages 2,3,4 --splits "" --out "$W/fp4_tiling.json"
grep -E "^  |^ +fp" "$W/fp4_tiling.log" | tail -45
