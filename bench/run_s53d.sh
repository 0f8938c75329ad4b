#!/usr/bin/env bash
# Session 53, call D (call C never started; ~140 s of device time left): the top-k's one-stage
# row with a tail (KVPLAN_TOPK_ROW_TAIL) writing from its registers (KVPLAN_TOPK_REG_WRITE)
# alone against the other modes (32 rows x 8,232 columns, 8,192 eligible, CUDA-graph
# medians), then its GPU tests (bit-exact against the torch path).
set -u
BUDGET=${BUDGET:-120}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 60 topk python3 bench/bench_sparse_kernels.py --only topk --rows 32 --candidates 8192 \
  --topk-width 8232 --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-130
gpu_tests tests 60 8 tests/ops/test_topk.py
grep -E "^FAILED|^ERROR" "$W/tests.log" | head
