#!/usr/bin/env bash
# Session 28, call D: the fused MoE weights on the GPU -- the DeepSeek-V4 GPU tests, the decode
# step's kernels at the workload's shape (batch 16, 4K), and the workload against HF.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 200 dsv4_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  tests/models/test_deepseek_v4_moe_fused.py tests/ops/test_moe_dense.py \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_graphs.py \
  tests/engine/test_hybrid_async.py tests/models/test_deepseek_v4_moe_grouped.py
grep -E "passed|failed|^FAILED|^ERROR" "$W/dsv4_tests.log" | tail -12
step 100 dec16 python3 bench/bench_hybrid.py --batch 16 --contexts 4096 --formats fp8 \
  --profile 2 --out "$W/dec16.json"
grep -E "ALL KERNELS|async|graphs|nvjet|swiglu|expert_sum|moe_route" "$W/dec16.log" | cut -c1-160
step 200 e2e python3 bench/bench_hybrid_hf.py --kv-formats fp8 --out "$W/e2e.json"
grep -E "hf|kvplan" "$W/e2e.log" | cut -c1-300 | tail -4
