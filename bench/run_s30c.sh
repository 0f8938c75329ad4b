#!/usr/bin/env bash
# Session 30, call B: the engine warmup (kvplan/engine/warmup.py, on by default with CUDA).
# The engine / server GPU tests (every LLM built there now warms up), then the first-request
# latency of new prompt lengths after the 4 x 2,048 workload with the warmup off and on, each
# process with an empty Triton cache (call A of this session, warmup not yet built: the first
# 8-token prompt 12,980 ms, then 26-28 ms).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 200 engine_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  tests/engine tests/server tests/bench
tail -3 "$W/engine_tests.log"
for w in off on; do
  step 170 first_$w env TRITON_CACHE_DIR="$(mktemp -d)" python3 bench/hybrid_steps.py \
    --profile "" --warmup $w --num-requests 4 --prompt-len 2048 --new-tokens 16 \
    --small 8,9,17,23,40,100,700 --out "$W/first_$w.json"
  grep -E "^engine|^one|^warm" "$W/first_$w.log"
done
