#!/usr/bin/env bash
# Session 52, call A: (1) DeepSeek-V4's o_b_proj as split-K partials added by the residual
# update (KVPLAN_DSV4_O_SPLITS): the GEMM alone at the decode shape, the 32K x 32 fp8 decode
# step alternating 0 / 2 splits; (2) the greedy argmax fused into the LM head and captured in
# the decode graphs (KVPLAN_GRAPH_ARGMAX): the LM head alone, the dense short workload end to
# end alternating; GPU tests of both first.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
gpu_tests tests 130 14 tests/ops/test_hyper_connection_split.py \
  tests/ops/test_hyper_connection_fused.py tests/models/test_deepseek_v4_blocks.py \
  tests/models/test_split_linear.py tests/engine/test_deepseek_v4_engine.py \
  tests/ops/test_small_gemm_argmax.py tests/ops/test_small_gemm.py tests/ops/test_argmax.py \
  tests/models/test_lm_head_argmax.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_hybrid_graphs.py tests/engine/test_async_scheduling.py \
  tests/engine/test_decode_fast_path.py
grep -E "^FAILED|^ERROR" "$W/tests.log" | head -20
step 40 lmhead python3 bench/bench_argmax.py --lm-head --out "$W/lmhead.json"
tail -8 "$W/lmhead.log"
step 50 gemm python3 bench/bench_split_linear.py --shapes 32,2048,4096,gemm 64,2048,4096,gemm \
  --splits 1,2,4 --out "$W/gemm.json"
grep -E "gemm " "$W/gemm.log" | cut -c1-120
for r in a b; do
  for v in 0 2; do hybrid_decode o$v$r 32 32768 KVPLAN_DSV4_O_SPLITS=$v; done
done
for r in a b; do
  short_run g0$r bf16 KVPLAN_GRAPH_ARGMAX=0
  short_run g1$r bf16 KVPLAN_GRAPH_ARGMAX=1
done
profile_32k p2 "nvjet|splitK|Memset|hc_proj|bmm|argmax|small_linear" KVPLAN_DSV4_O_SPLITS=2
hybrid_decode a0 32 32768 KVPLAN_GRAPH_ARGMAX=0
for v in 0 2; do hybrid_decode o$v"c" 32 32768 KVPLAN_DSV4_O_SPLITS=$v; done
