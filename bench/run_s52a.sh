#!/usr/bin/env bash
# Session 52, call A: DeepSeek-V4's o_b_proj as split-K partials added by the residual
# update (KVPLAN_DSV4_O_SPLITS) -- its GPU tests, the GEMM alone at the decode shape, the 32K x
# 32 fp8 decode step alternating 0 / 2 splits (and 4 once), batch 64, one profile.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
gpu_tests tests 110 14 tests/ops/test_hyper_connection_split.py \
  tests/ops/test_hyper_connection_fused.py tests/models/test_deepseek_v4_blocks.py \
  tests/models/test_split_linear.py tests/engine/test_deepseek_v4_engine.py
step 60 gemm python3 bench/bench_split_linear.py --shapes 32,2048,4096,gemm 64,2048,4096,gemm \
  --splits 1,2,4 --out "$W/gemm.json"
grep -E "gemm " "$W/gemm.log" | cut -c1-120
for r in a b; do
  for v in 0 2; do hybrid_decode o$v$r 32 32768 KVPLAN_DSV4_O_SPLITS=$v; done
done
hybrid_decode o4a 32 32768 KVPLAN_DSV4_O_SPLITS=4
for v in 0 2; do hybrid_decode b64o$v 64 32768 KVPLAN_DSV4_O_SPLITS=$v; done
profile_32k p2 "nvjet|splitK|Memset|hc_proj|hc_pre|bmm" KVPLAN_DSV4_O_SPLITS=2
for v in 0 2; do hybrid_decode o$v"c" 32 32768 KVPLAN_DSV4_O_SPLITS=$v; done
