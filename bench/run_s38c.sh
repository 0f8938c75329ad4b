#!/usr/bin/env bash
# Prepared in session 37: V41 FP8 records read as fp16 tiles in the sparse attention
# (KVPLAN_SPARSE_FP8_F16=1: one e4m3x2 -> f16x2 conversion and one fp16 multiply a pair of
# values instead of a conversion to fp32, a multiply and a rounding to bf16 each; sm_90 split
# kernel at the default launch 1,234 vs 1,377 main-loop instructions, 154.2 vs 172.1 warp
# instructions a key: bench/hybrid_kernel_regs.py --fp8-f16), off against on.
# 1. GPU tests of the sparse kernels (test_cuda_fp8_f16_tiles_v4_shapes sets the switch);
# 2. the attention kernels alone at 256 rows (128 + 512 / 1,024 keys);
# 3. the DeepSeek-V4-shaped decode step at 128K x 256 and 32K x 32.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests f16_tests 110 8 tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py
for v in 0 1; do sparse_kernels att_v$v 256 1024 KVPLAN_SPARSE_FP8_F16=$v; done
for v in 0 1; do HD_SECS=80 hybrid_decode d128_v$v 256 131072 KVPLAN_SPARSE_FP8_F16=$v; done
for v in 0 1; do hybrid_decode d32_v$v 32 32768 KVPLAN_SPARSE_FP8_F16=$v; done
