#!/usr/bin/env bash
# Session 43, call B: the GPU tests of DeepSeek-V4 speculative decoding (and every hybrid
# engine GPU test beside them: graphs, async steps, prefix caching), then where the decode
# step's torch-launched work comes from (`hybrid_small_ops.py`: each aten op that launches
# device work, by source line), at 4K and 32K x 32, fp8.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests spec 300 8 tests/engine/test_hybrid_speculative.py tests/engine/test_deepseek_v4_engine.py \
  tests/engine/test_hybrid_graphs.py tests/engine/test_hybrid_async.py \
  tests/engine/test_hybrid_prefix_cache.py
step 90 ops4k python3 bench/hybrid_small_ops.py --context 4096 --out "$W/ops4k.json"
head -45 "$W/ops4k.log"
step 120 ops32k python3 bench/hybrid_small_ops.py --context 32768 --out "$W/ops32k.json"
head -12 "$W/ops32k.log"
