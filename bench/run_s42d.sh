#!/usr/bin/env bash
# Session 42's fourth call, at commit b140c5b (the code was reverted after it: no gain): the
# MoE routing inside the weighted sum's kernel (KVPLAN_MOE_FUSED_ROUTE, 12 launches fewer a
# DeepSeek-V4 decode step). Its GPU tests, the 32K x 32 fp8 decode step off / on alternating
# four times, one profile with it on.
set -u
BUDGET=${BUDGET:-230}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 60 14 tests/ops/test_moe_dense.py tests/models/test_deepseek_v4_moe_fused.py
for v in 0 1 0 1 0 1 0 1; do
  hybrid_decode "d32k_r$v" 32 32768 KVPLAN_MOE_FUSED_ROUTE=$v
done
step 30 p32k_r1 env KVPLAN_MOE_FUSED_ROUTE=1 python3 bench/bench_hybrid.py --batch 32 \
  --contexts 32768 --formats fp8 --profile 2 --out "$W/p32k_r1.json"
grep -E "ALL KERNELS|moe_route|expert_sum|async" "$W/p32k_r1.log"
