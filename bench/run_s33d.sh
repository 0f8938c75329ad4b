#!/usr/bin/env bash
# Session 33, call D: DeepSeek-V4 prompts keep their state inside the chunk (KeepPoints).
# 1. GPU tests of the hybrid prefix cache (graphs, async steps, fp8) and the index kernels;
# 2. bench/hybrid_keep_state.py: one engine, a new 1,000-token prompt and a question after a
#    primed 4,000-token system prompt, the chunk cut at the boundary vs the state kept inside;
# 3. the indexer's mxfp8 scoring: key tiles per program x software pipelining; the top-k
#    alone at 256 x 32,768.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
gpu_tests prefix_tests 120 8 tests/engine/test_hybrid_prefix_cache.py tests/ops/test_sparse_attention.py
step 150 keep python3 bench/hybrid_keep_state.py --out "$W/keep.json"
grep -E "^(cut|keep)|speedup" "$W/keep.log"
step 70 s256 python3 bench/bench_sparse_kernels.py --only index --rows 256 --candidates 32768 \
  --index-kinds mxfp8 --sweep-stages --out "$W/s256.json"
grep -E "index_scores" "$W/s256.log" | cut -c1-150
step 40 topk python3 bench/bench_sparse_kernels.py --only topk --rows 256 --candidates 32768 \
  --out "$W/topk.json"
grep -E "topk" "$W/topk.log" | cut -c1-150 | head -30
