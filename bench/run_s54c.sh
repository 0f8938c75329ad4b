#!/usr/bin/env bash
# Session 54, call C (after call B: the row-tile Sinkhorn form was slower, 7.8 us a hc_pre
# launch, and hc_proj projecting from registers made it 53 us a launch; both reverted):
# hc_pre_kernel's decode launch at 4 warps (KVPLAN_HC_PRE_WARPS=4, the token form: no barrier
# in its Sinkhorn loop, no spills) against 1 warp, alone (bench_dsv4_blocks --hc-only: the
# pair with the model's norm, hc_pp_norm@32) and in the 32K x 32 fp8 decode step (three
# alternating pairs, then one profiled step each); then the GPU tests of the changed code
# (the top-k's register forms are on by default now).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for w in 1 4; do
  step 40 "blk_w$w" env KVPLAN_HC_PRE_WARPS=$w python3 bench/bench_dsv4_blocks.py --hc-only \
    --hc-rows 32 --iters 200 --out "$W/blk_w$w.json"
  grep -E "^hc " "$W/blk_w$w.log"; grep -E "^hc_(post_pre|pp_norm)@32" "$W/blk_w$w.log"
done
HD_SECS=75 hybrid_decode w1a 32 32768
hybrid_decode w4a 32 32768 KVPLAN_HC_PRE_WARPS=4
for r in b c; do
  hybrid_decode w1$r 32 32768
  hybrid_decode w4$r 32 32768 KVPLAN_HC_PRE_WARPS=4
done
profile_32k prof1 "hc_pr|_topk|index_scores"
profile_32k prof4 "hc_pr|_topk|index_scores" KVPLAN_HC_PRE_WARPS=4
gpu_tests tests 110 14 tests/ops/test_hyper_connection.py tests/ops/test_hyper_connection_fused.py \
  tests/ops/test_hyper_connection_rows.py tests/ops/test_hyper_connection_norm.py \
  tests/ops/test_hyper_connection_split.py tests/ops/test_topk.py \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_graphs.py
