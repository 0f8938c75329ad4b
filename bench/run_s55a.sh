#!/usr/bin/env bash
# Prepared in session 54 for the next session's first call (best on an H200, where issue
# 14's and 17's targets are set; on an H100 it still gives the A/Bs). Session 54 switched on,
# from H100 measurements only, hc_proj's fn load first (KVPLAN_HC_FN_FIRST) and the indexer's
# 64-key tiles (KVPLAN_INDEX_TILE_N): here both against the old launches in profiled 32K x 32
# fp8 steps (alternating), then the plain steps for the target's ratio, hc_pre at two decode
# warps (profiled), the index tiles alone,
# the dense batch-64 decode (issue 17), and the GPU tests of the changed kernels.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
OLD="KVPLAN_HC_FN_FIRST=0 KVPLAN_INDEX_TILE_N=128"
# the first step compiles the model's kernels on a fresh machine
step 80 p_new_a python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --profile 2 --out "$W/p_new_a.json"
grep -E "ALL KERNELS|async|hc_proj|index_scores" "$W/p_new_a.log"
# shellcheck disable=SC2086
profile_32k p_old_a "hc_proj|index_scores|ALL" $OLD
profile_32k p_new_b "hc_proj|index_scores|ALL"
# shellcheck disable=SC2086
profile_32k p_old_b "hc_proj|index_scores|ALL" $OLD
for r in a b; do hybrid_decode d_$r 32 32768; done
# hc_pre's decode programs at two warps (one spills 44 bytes a thread; four measured slower)
profile_32k p_w2 "hc_pre|ALL" KVPLAN_HC_PRE_WARPS=2
step 60 index python3 bench/bench_sparse_kernels.py --only index --rows 32 --candidates 8192 \
  --index-kinds mxfp8 --sweep --out "$W/index.json"
grep -E "^index" "$W/index.log" | cut -c1-130
for r in a b; do short_run dense_$r bf16; done
gpu_tests tests 100 14 tests/ops/test_hyper_connection.py tests/ops/test_hyper_connection_fused.py \
  tests/ops/test_hyper_connection_norm.py tests/ops/test_index_scores_seq.py \
  tests/ops/test_sparse_attention.py tests/engine/test_deepseek_v4_engine.py \
  tests/engine/test_hybrid_graphs.py
