#!/usr/bin/env bash
# Session 38, after call C: fp16 tiles for fp8 sources in the DeepSeek-V4 decode step with the
# indexer at its default launch (one 128-key tile a program: 0.548 vs 0.587 ms alone at
# 256 x 32,768 in call C; call C's engine run had 2 tiles a program, 0.675 ms), and fp4 /
# int8 taking two KV heads a program by default (DECODE_HEADS_AUTO, from calls A and B).
# 1. GPU tests: the fp16 tiles (-k f16, the index test fixed), the decode graphs' tiers;
# 2. hybrid decode 128K x 256: both switches off / the attention's only / both on;
# 3. hybrid decode 32K x 32: off / both on;
# 4. the long dense workload with fp4 pages at the new default (two heads above 1,024 keys,
#    decode graphs per tier).
set -u
BUDGET=${BUDGET:-470}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 75 tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  -k "f16 or tier or graph" tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py \
  tests/engine/test_cuda_graphs.py tests/engine/test_quantized_kv_engine.py
tail -3 "$W/tests.log"
HD_SECS=80 hybrid_decode d128_off 256 131072 KVPLAN_SPARSE_FP8_F16=0 KVPLAN_INDEX_FP8_F16=0
HD_SECS=80 hybrid_decode d128_att 256 131072 KVPLAN_SPARSE_FP8_F16=1 KVPLAN_INDEX_FP8_F16=0
HD_SECS=80 hybrid_decode d128_both 256 131072 KVPLAN_SPARSE_FP8_F16=1 KVPLAN_INDEX_FP8_F16=1
hybrid_decode d32_off 32 32768 KVPLAN_SPARSE_FP8_F16=0 KVPLAN_INDEX_FP8_F16=0
hybrid_decode d32_both 32 32768 KVPLAN_SPARSE_FP8_F16=1 KVPLAN_INDEX_FP8_F16=1
LONG_SECS=60 long_run long_fp4 fp4
