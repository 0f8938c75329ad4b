#!/usr/bin/env bash
# Session 24, call D: the formats side by side after the fused fp4 store, and where the
# short decode and the long prefill spend their time.
# 1. Long workload (32 x 8,192 x 256): bf16, fp8, int8, fp4 in one call (issue 17's ratios).
# 2. Decode attention at the short workload's shape (64 x 320): page lookups a tile ahead
#    (mode 2) for bf16 too, 2 / 3 / 5 stages.
# 3. One 8,192-token prefill per format, kernels by name (the mixed steps are 60 % of the
#    long workload).
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
for f in bf16 fp8 int8 fp4; do long_run "long_$f" $f; done
step 60 short_attn python3 bench/bench_quant_decode.py --graph --batch 64 --context 320 --formats bf16,fp8,fp4 --tiles 64 --warps 2 --stages 2,3,5 --prefetch 2 --splits "" --out "$W/short_attn.json"
grep -E "^  " "$W/short_attn.log"
step 90 prefill_prof python3 bench/profile_prefill.py --variants bf16,fp8,fp4 --prompts 3 --top 16 --out "$W/prefill_prof.json"
grep -vE "Warning|warn" "$W/prefill_prof.log" | head -70
