#!/usr/bin/env bash
# Session 36, call D (what call C would have been, cut to the device time left): two KV heads
# a program at (32 keys, 2 warps, 3 stages), the fastest fp8 launch of call B at 32 x 8K.
# 1. GPU tests of the decode kernel's files with KVPLAN_DECODE_HEADS=2 and that tiling for
#    every format (call B's run with heads 2 at the default tilings hit 3 failures; head_dim
#    128 at those tilings needs more shared memory than an SM has);
# 2. the engine's long workload (32 x 8,192 x 256, fp8) with it, then without.
set -u
BUDGET=${BUDGET:-195}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 85 hd2_tests env KVPLAN_DECODE_HEADS=2 KVPLAN_DECODE_TILING=32,2,3 python3 -m pytest -q \
  -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention.py \
  tests/ops/test_paged_attention_quantized.py
grep -E "passed|failed|^FAILED|^E  " "$W/hd2_tests.log" | head -30
long_run long_fp8_h2 fp8 KVPLAN_DECODE_HEADS=2 KVPLAN_DECODE_TILING=32,2,3
long_run long_fp8_h1 fp8
