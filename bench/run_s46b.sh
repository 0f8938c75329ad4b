#!/usr/bin/env bash
# (Never ran: every start was refused until call C, which ran its A/Bs; the switches it sets were
# removed after call C measured them: see bench/RESULTS.md, session 46.)
# Session 46, call B: V41 fp8 records read as fp16 rows in the sparse attention
# (KVPLAN_SPARSE_FP8_F16_ROWS: each row normalized by its largest scale, that scale on its
# logits and in the softmax's exponent): GPU tests of the sparse kernels and the DeepSeek-V4
# engine with the flag on, the kernel alone at 256 rows, then the decode step at 32K x 32 and
# 128K x 256 with the flag off / on.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 150 tests env KVPLAN_SPARSE_FP8_F16_ROWS=1 python3 -m pytest -q -m gpu -n 8 \
  -p no:cacheprovider --tb=short -rf tests/ops/test_sparse_split.py tests/ops/test_sparse_attention.py \
  tests/engine/test_deepseek_v4_engine.py
tail -3 "$W/tests.log"
for f in 0 1; do sparse_kernels "k256_$f" 256 1024 KVPLAN_SPARSE_FP8_F16_ROWS=$f; done
for f in 0 1; do hybrid_decode "d32k_$f" 32 32768 KVPLAN_SPARSE_FP8_F16_ROWS=$f; done
for f in 0 1; do HD_SECS=80 hybrid_decode "d128k_$f" 256 131072 KVPLAN_SPARSE_FP8_F16_ROWS=$f; done
