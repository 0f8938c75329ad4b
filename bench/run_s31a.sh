#!/usr/bin/env bash
# Prepared in session 30 for the next session's first call (its device time ran out after
# call D). Session 30's last commits after its GPU suite: the warmup's logprobs phase, the
# clearer warmup failure, first_request.py. So: the engine / server / bench GPU tests, then
# the dense engine's first-request latency with the warmup off / on (random llama-1b, empty
# Triton cache each, then once more each with the cache the first pair filled), and the hybrid
# decode step at 32K x 32 (session 30: async 2.65 ms, 2.8x its floor).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
gpu_tests engine_tests 150 8 tests/engine tests/server tests/bench
shared="$(mktemp -d)"
for w in off on; do
  step 120 dense_$w env TRITON_CACHE_DIR="$(mktemp -d)" python3 bench/first_request.py \
    --warmup $w --out "$W/dense_$w.json"
  grep -E "^engine|^warm|^one" "$W/dense_$w.log"
done
for w in on off on; do  # one shared cache: the first run compiles, the others reuse
  step 90 "dense_cached_$w" env TRITON_CACHE_DIR="$shared" python3 bench/first_request.py \
    --warmup $w --out "$W/dense_cached_$w.json"
  grep -E "^engine|^one" "$W/dense_cached_$w.log"
done
step 120 dec32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --out "$W/dec32k.json"  # (hybrid_decode's 35 s is too short with an empty cache)
grep -E "^ *fp8 |async" "$W/dec32k.log"
