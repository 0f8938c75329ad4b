#!/usr/bin/env bash
# Session 38's last call: the whole GPU suite on the session's final code (fp4 / int8 with two
# KV heads a program by default, the fp16 tiles for fp8 sources removed), then the long dense
# workload (32 x 8,192 x 256) with fp8, fp4 and bf16 pages side by side.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 380 14 tests
for fmt in fp8 fp4 bf16; do LONG_SECS=58 long_run "long_$fmt" "$fmt"; done
