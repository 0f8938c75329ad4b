#!/usr/bin/env bash
# Session 37, call C: fp8 decode launches take two KV heads a program above 4,096 keys
# (DECODE_HEADS_AUTO) and the dense decode graphs are captured per context tier.
# 1. GPU tests: decode graphs (context tiers with the bound lowered to 32 keys), quantized
#    engine graphs;
# 2. the long workload (32 x 8,192 x 256): fp8 default (two heads) vs KVPLAN_DECODE_HEADS=1
#    (the former default), and bf16 for the fp8 / bf16 ratio; the short workload
#    (64 x 256 x 128): fp8 default vs KVPLAN_DECODE_HEADS=1 (both one head: max_model_len 416).
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 110 12 tests/engine/test_cuda_graphs.py tests/engine/test_quantized_kv_engine.py
long_run long_fp8_auto fp8
long_run long_fp8_h1 fp8 KVPLAN_DECODE_HEADS=1
long_run long_bf16 bf16
short_run short_auto fp8
short_run short_h1 fp8 KVPLAN_DECODE_HEADS=1
