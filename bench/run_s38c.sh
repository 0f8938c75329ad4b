#!/usr/bin/env bash
# Prepared in session 37, extended in session 38: fp16 tiles for fp8 sources, off against on.
# - the sparse attention over V41 FP8 records (KVPLAN_SPARSE_FP8_F16=1: one e4m3x2 -> f16x2
#   conversion and one fp16 multiply a pair of values instead of a conversion to fp32, a
#   multiply and a rounding to bf16 each; sm_90 split kernel at the default launch 1,234 vs
#   1,377 main-loop instructions: bench/hybrid_kernel_regs.py --fp8-f16);
# - the indexer over mxfp8 index keys (KVPLAN_INDEX_FP8_F16=1, session 38: 839 vs 1,036
#   main-loop instructions a 128-key tile at 2 tiles a program, its default with fp16 tiles).
# 1. GPU tests of the fp16 tiles (-k f16);
# 2. the indexer alone at 256 x 32,768 (bf16 vs fp16 tiles, 1 / 2 / 4 tiles x 4 / 8 warps);
# 3. the attention kernels alone at 256 rows (128 + 512 / 1,024 keys), off / on;
# 4. the DeepSeek-V4-shaped decode step at 128K x 256, both off / both on.
set -u
BUDGET=${BUDGET:-400}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 60 f16_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  -k f16 tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py
tail -3 "$W/f16_tests.log"
step 60 index_f16 python3 bench/bench_sparse_kernels.py --only index --index-kinds mxfp8 \
  --rows 256 --candidates 32768 --index-f16 --out "$W/index_f16.json"
grep -E "^index_scores" "$W/index_f16.log" | cut -c1-160
for v in 0 1; do sparse_kernels att_v$v 256 1024 KVPLAN_SPARSE_FP8_F16=$v; done
for v in 0 1; do
  HD_SECS=80 hybrid_decode d128_v$v 256 131072 KVPLAN_SPARSE_FP8_F16=$v KVPLAN_INDEX_FP8_F16=$v
done
