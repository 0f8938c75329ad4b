#!/usr/bin/env bash
# (Measured at commit eb990d0; slower at 256 rows, reverted in the next commit: bench/RESULTS.md, session 35.)
# Session 35, call B: V41 fp8 records attended one scale group at a time
# (KVPLAN_SPARSE_FP8_GROUPS=1: codes into the dots as stored, scales on the logits and on the
# probabilities, code loads pipelined by the key loop) against the dequantized tile.
# 1. GPU tests of the sparse kernels (the new group test included);
# 2. the kernel alone at 32 and 256 decode rows (bench_sparse_kernels.py --only attention);
# 3. the DeepSeek-V4-shaped decode step at 32K x 32 and 128K x 256, fp8 tile / groups, bf16 rows.
set -u
BUDGET=${BUDGET:-520}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests sparse_tests 90 8 tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py
for g in 0 1; do
  step 40 k32_g$g env KVPLAN_SPARSE_FP8_GROUPS=$g python3 bench/bench_sparse_kernels.py \
    --only attention --no-chunked --rows 32 --hca-entries 256 --out "$W/k32_g$g.json"
  grep -E "sparse_attention|default|new " "$W/k32_g$g.log" | cut -c1-160 | head -8
  step 45 k256_g$g env KVPLAN_SPARSE_FP8_GROUPS=$g python3 bench/bench_sparse_kernels.py \
    --only attention --no-chunked --rows 256 --hca-entries 1024 --out "$W/k256_g$g.json"
  grep -E "sparse_attention|default|new " "$W/k256_g$g.log" | cut -c1-160 | head -8
done
hybrid_decode d32_g0 32 32768 KVPLAN_SPARSE_FP8_GROUPS=0
hybrid_decode d32_g1 32 32768 KVPLAN_SPARSE_FP8_GROUPS=1
step 70 d128_g0 python3 bench/bench_hybrid.py --batch 256 --contexts 131072 --formats fp8,exact \
  --out "$W/d128_g0.json"
grep -E "^ *(fp8|exact) |async" "$W/d128_g0.log"
hybrid_decode d128_g1 256 131072 KVPLAN_SPARSE_FP8_GROUPS=1
hybrid_decode d128_g1u 256 131072 KVPLAN_SPARSE_FP8_GROUPS=1 KVPLAN_SPARSE_FUSED_COMBINE=0 KVPLAN_SPARSE_GROUP_PPS=3
hybrid_decode d32_g1t 32 32768 KVPLAN_SPARSE_FP8_GROUPS=1 KVPLAN_SPARSE_GROUP_TILING=64,8,3 KVPLAN_SPARSE_GROUP_PPS=1
