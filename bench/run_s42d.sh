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
decode_ab KVPLAN_MOE_FUSED_ROUTE d32k_r 0 1 0 1 0 1 0 1
profile_32k p32k_r1 "moe_route|expert_sum" KVPLAN_MOE_FUSED_ROUTE=1
