#!/usr/bin/env bash
# Prepared in session 32 (no device in sessions 31 and 32): session 31's call (bench/run_s31a.sh:
# engine / server / bench GPU tests with the DeepSeek-V4 prefix-cache GPU test, the hybrid
# prefix-cache workloads, the dense first-request warmup A/B, the hybrid decode step at 32K x 32)
# plus session 32's waiting for shared prefixes: the dense shared-system-prompt workload
# (random llama-1b, 32 requests x (2,000 shared + 100 own) tokens, cache off / on without
# waiting / on with it). hybrid_prefix_cache.py now also runs its rounds without waiting.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
gpu_tests engine_tests 150 8 tests/engine tests/server tests/bench
step 150 prefix python3 bench/hybrid_prefix_cache.py --out "$W/prefix.json"
grep -E "^cache|speedup|equal" "$W/prefix.log"
step 90 shared python3 bench/shared_prefix.py --out "$W/shared.json"
grep -E "^(off|nowait|wait) |speedup|equal" "$W/shared.log"
for w in off on; do
  step 100 dense_$w env TRITON_CACHE_DIR="$(mktemp -d)" python3 bench/first_request.py \
    --warmup $w --out "$W/dense_$w.json"
  grep -E "^engine|^warm|^one" "$W/dense_$w.log"
done
step 100 dec32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --out "$W/dec32k.json"
grep -E "^ *fp8 |async" "$W/dec32k.log"
