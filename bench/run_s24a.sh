#!/usr/bin/env bash
# Prepared in session 23 (device time spent) for the next session's first call: fp4 tiles in
# nibble order, built and compiled for sm_90 here, not yet run on a GPU:
# - dense decode (KVPLAN_FP4_NIBBLES / FP4_NIBBLE_TILES, off): main loop 774 instructions at the
#   128-register cap against 1,026 for today's fp16 tiles (fp8: 910 at 168);
# - hybrid sparse attention (KVPLAN_SPARSE_FP4_NIBBLES, off): split kernel 1,381 against 2,042.
# Both leave the values 2^-14 small (fp16 subnormals enter the MMAs): the GPU tests check that
# the tensor cores keep them.
# 1. GPU tests of the fp4 paths (tile bit-exactness, decode vs the bf16 copy, sparse at the
#    DeepSeek-V4 shapes, engines), nibble tiles included.
# 2. fp4 per call, 32 x 8K: default vs nibble tiles, caps 0 / 128 / 112, 4 / 8 splits; fp8.
# 3. Long workload: fp4 with KVPLAN_FP4_NIBBLES=0 / 1, fp8 beside.
# 4. Hybrid decode with fp4 records, KVPLAN_SPARSE_FP4_NIBBLES=0 / 1, fp8 beside (32K, 128K).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 200 gpu_tests python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf --durations=8 tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py tests/ops/test_sparse_split.py tests/engine/test_deepseek_v4_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
step 60 fp4_b32 python3 bench/bench_quant_decode.py --graph --formats fp4,fp8 --no-tiling --fp4-nibbles --maxnreg 128,112 --with-splits 4,8 --splits "" --out "$W/fp4_b32.json"
grep -E "^  " "$W/fp4_b32.log"
long_run long_fp4 fp4 KVPLAN_FP4_NIBBLES=0
long_run long_fp4_nib fp4 KVPLAN_FP4_NIBBLES=1
long_run long_fp8 fp8 KVPLAN_FP4_NIBBLES=0
hybrid_ab KVPLAN_SPARSE_FP4_NIBBLES hybrid_fp4_nib
