#!/usr/bin/env bash
# Session 39, call E: what context tiers cost and give in the engine. The DeepSeek-V4 bench
# model (random bf16 weights) under max_model_len 131,072 with 16 requests x 2,048 prompt
# tokens x 64 new: engine build time (load, warmup, captures), graphs captured, memory
# reserved, and the median decode step, with tiers (default) and with one graph per bucket.
set -u
BUDGET=${BUDGET:-250}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for t in tiers notiers; do
  step 120 steps_$t python3 bench/hybrid_steps.py --num-requests 16 --prompt-len 2048 \
    --new-tokens 64 --max-model-len 131072 --profile "" --small "" \
    $([ $t = notiers ] && echo --no-tiers) --out "$W/steps_$t.json"
  grep -E "engine built|warm run|decode steps" "$W/steps_$t.log"
done
