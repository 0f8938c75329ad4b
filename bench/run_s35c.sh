#!/usr/bin/env bash
# (Measured at commit e39728e on an H100: slower; the switch was removed in the next commit. bench/RESULTS.md, session 35.)
# Session 35, call C (rewritten before it ran): the split sparse attention's V41 fp8 values
# loaded as a 3-D [keys, groups, 32] tile under the loop's own pipelining attribute
# (KVPLAN_SPARSE_VALUES_3D=1): sm_90 compile here puts the value bytes in cp.async copies (one
# 32 KB buffer) and dequantizes them in the two dot-operand layouts (no bf16 tile in shared
# memory: 53 KB instead of 149 KB, 190 registers instead of 230, 1,884 main-loop instructions
# instead of 1,373). GPU tests with the switch on, then the kernel alone off / on.
set -u
BUDGET=${BUDGET:-320}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for v in 1 0; do
  step 65 k256_v$v env KVPLAN_SPARSE_VALUES_3D=$v python3 bench/bench_sparse_kernels.py \
    --only attention --no-chunked --rows 256 --hca-entries 1024 --out "$W/k256_v$v.json"
  grep -E "^sparse_attention" "$W/k256_v$v.log" | cut -c1-150
done
KVPLAN_SPARSE_VALUES_3D=1 gpu_tests v3d_tests 60 8 tests/ops/test_sparse_attention.py
step 70 d128_v1 env KVPLAN_SPARSE_VALUES_3D=1 python3 bench/bench_hybrid.py --batch 256 \
  --contexts 131072 --formats fp8 --out "$W/d128_v1.json"
grep -E "^ *fp8 |async" "$W/d128_v1.log"
step 70 k32_v1 env KVPLAN_SPARSE_VALUES_3D=1 python3 bench/bench_sparse_kernels.py \
  --only attention --no-chunked --rows 32 --hca-entries 256 --out "$W/k32_v1.json"
grep -E "^sparse_attention" "$W/k32_v1.log" | cut -c1-150
