#!/usr/bin/env bash
# Prepared in session 30 for the next session's first call; session 31 had no device, so it
# also carries session 31's work: DeepSeek-V4 prefix caching (state snapshots). So: the
# engine / server / bench GPU tests (session 30's warmup additions, session 31's prefix-cache
# GPU test with graphs and async steps), the hybrid prefix-cache workloads with the cache off
# and on (4,096-token system prompt + 16 questions; a 6-turn conversation), the dense
# engine's first-request latency with the warmup off / on (random llama-1b, empty Triton cache
# each), and the hybrid decode step at 32K x 32 (session 30: async 2.65 ms, 2.8x its floor).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
gpu_tests engine_tests 150 8 tests/engine tests/server tests/bench
step 130 prefix python3 bench/hybrid_prefix_cache.py --out "$W/prefix.json"
grep -E "^cache|speedup|equal" "$W/prefix.log"
for w in off on; do
  step 100 dense_$w env TRITON_CACHE_DIR="$(mktemp -d)" python3 bench/first_request.py \
    --warmup $w --out "$W/dense_$w.json"
  grep -E "^engine|^warm|^one" "$W/dense_$w.log"
done
step 100 dec32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --out "$W/dec32k.json"  # (hybrid_decode's 35 s is too short with an empty cache)
grep -E "^ *fp8 |async" "$W/dec32k.log"
