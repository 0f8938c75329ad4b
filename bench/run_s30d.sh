#!/usr/bin/env bash
# Session 30, call C: the warmup with a warm Triton cache, and whether a warmed process runs
# its later steps differently (call B: small prompts 1-2 ms slower, the 8,192-token step and
# the decode steps faster, one process each). Five processes alternating warmup on / off, one
# shared Triton cache: the first (on) compiles; the other four find every kernel compiled.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
export TRITON_CACHE_DIR="$(mktemp -d)"
i=0
for w in on off on off on; do
  i=$((i + 1))
  step 150 "w${i}_$w" python3 bench/hybrid_steps.py --profile "" --warmup $w --num-requests 4 \
    --prompt-len 2048 --new-tokens 16 --small 8,100,700 --out "$W/w${i}_$w.json"
  grep -E "^engine|^one|^warm|median|prefill:" "$W/w${i}_$w.log"
done
