#!/usr/bin/env bash
# Session 13, second device call: GPU tests of the new defaults (sparse attention tilings, hc
# projection target) and of the top-k's in-register row and split search; the top-k sweep at
# the decode shapes (batch 32 at 32K / 128K context, batch 256 at 128K); the bf16-rows
# attention sweep at 256 rows (the exact format's one-program tiling); the hybrid decode steps
# with the new defaults.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
step 150 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_topk.py tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py tests/ops/test_hyper_connection_fused.py tests/ops/test_hyper_connection.py tests/backends/test_hybrid_gpu_kernels.py tests/engine/test_deepseek_v4_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -8
step 60 topk32 python3 bench/bench_sparse_kernels.py --rows 32 --candidates 8192,32768 --only topk --out "$W/topk32.json"
grep -E "FASTEST|old  " "$W/topk32.log"
step 50 topk256 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --only topk --out "$W/topk256.json"
grep -E "FASTEST|old  " "$W/topk256.log"
step 45 hybrid_b32 python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --profile 1 --out "$W/hybrid_b32.json"
grep -E "^ +(fp8|exact) |async|ALL KERNELS|topk|sparse_att|hc_proj" "$W/hybrid_b32.log" | head -30
step 45 hybrid_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --profile 1 --out "$W/hybrid_b256.json"
grep -E "131072|async|ALL KERNELS|hc_proj|index_scores|sparse_att|topk" "$W/hybrid_b256.log" | head -16
step 60 attn256bf16 python3 bench/bench_sparse_kernels.py --rows 256 --only attention --attention-sweep stages --hca-entries 1024 --attention-format bf16 --out "$W/attn256bf16.json"
grep -E "FASTEST|old  |new  " "$W/attn256bf16.log" | tail -6
