#!/usr/bin/env bash
# Session 54, call B: the hyper-connection pair's new launch (hc_pre's post / comb by row
# tiles of KVPLAN_HC_SINKHORN_ROWS tokens, so the launch takes KVPLAN_HC_PRE_WARPS = 4 warps
# for the block input; hc_proj's fused form projects its tile from registers, no read back)
# and the top-k's register forms now on by default. First the pair alone at 32 rows
# (bench_dsv4_blocks --hc-only, graph replay) for the old launch (0 rows, 1 warp), the token
# form at 4 warps and row tiles of 4 / 32; then the 32K x 32 fp8 decode step, new defaults
# against the old launch and top-k (three alternating pairs); one profiled step; GPU tests.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for v in "0 1" "0 4" "4 4" "32 4"; do
  set -- $v
  step 45 "blk_$1_$2" env KVPLAN_HC_SINKHORN_ROWS=$1 KVPLAN_HC_PRE_WARPS=$2 \
    python3 bench/bench_dsv4_blocks.py --hc-only --hc-rows 32 --iters 200 --out "$W/blk_$1_$2.json"
  grep -E "^hc " "$W/blk_$1_$2.log"; grep -E "^hc_post_pre@32" "$W/blk_$1_$2.log"
done
OLD="KVPLAN_HC_SINKHORN_ROWS=0 KVPLAN_HC_PRE_WARPS=1 KVPLAN_TOPK_ROW_TAIL=0 KVPLAN_TOPK_REG_WRITE=0"
HD_SECS=75 hybrid_decode n_a 32 32768
for r in a b c; do
  # shellcheck disable=SC2086
  hybrid_decode o_$r 32 32768 $OLD
  [ "$r" = a ] || hybrid_decode n_$r 32 32768
done
profile_32k prof "hc_pr|_topk|index_scores"
gpu_tests tests 110 14 tests/ops/test_hyper_connection.py tests/ops/test_hyper_connection_fused.py \
  tests/ops/test_hyper_connection_rows.py tests/ops/test_hyper_connection_norm.py \
  tests/ops/test_hyper_connection_split.py tests/ops/test_topk.py \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_graphs.py
