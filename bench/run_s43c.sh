#!/usr/bin/env bash
# Session 43, call C: the indexer's head-weight scaling folded into its query RoPE launch
# (`rope_and_scale`, `KVPLAN_FUSED_INDEX_WEIGHTS`) and the split top-k's second stage without
# its count fill (`_topk_kernel` ALL): their GPU tests, the DeepSeek-V4 model and engine GPU
# tests, then the 32K x 32 fp8 decode step with the fold on and off, alternating, and one
# profiled step.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ops 170 8 tests/ops/test_rope.py tests/ops/test_topk.py tests/models/test_deepseek_v4_*.py \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_speculative.py
decode_ab KVPLAN_FUSED_INDEX_WEIGHTS d32k_w 1 0 1 0 1 0
profile_32k p32k "topk|norm_rope|elementwise|Fill|copy"
