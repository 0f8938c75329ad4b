#!/usr/bin/env bash
# Session 41's first call: the whole GPU suite first (session 40's GPU-visible changes,
# `AttentionMetadata.kernel_view` and the short-prompt quantized DeepSeek-V4 test, had no GPU
# run yet), then the DeepSeek-V4 engine build with and without decode graphs by context tier
# (bench/run_s40a.sh's steps) in what is left.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 340 14 tests
for v in notiers:100 tiers:100 notiers2:60; do
  t=${v%%:*}
  step ${v#*:} steps_$t python3 bench/hybrid_steps.py --num-requests 16 --prompt-len 2048 \
    --new-tokens 64 --max-model-len 131072 --profile "" --small "" \
    $([ "${t%2}" = notiers ] && echo --no-tiers) --out "$W/steps_$t.json"
  grep -E "engine built|warm run|decode steps" "$W/steps_$t.log"
done
