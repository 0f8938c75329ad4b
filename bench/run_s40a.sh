#!/usr/bin/env bash
# Prepared in session 39 for the next session's first call: the DeepSeek-V4 engine's build
# with decode graphs by context tier against one graph a bucket, on a warm Triton cache
# (session 39's tiered build ran first on a cold cache and did not finish inside its 120 s
# step; the tier-less build after it took 21.0 s): one graph first (a cold cache: compiles),
# then tiers, then one graph again; build seconds, graphs captured, memory, decode step.
# Then the whole GPU suite (session 39's last suite stopped at its step limit at 98 % with
# no failure) in what is left.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for v in notiers:170 tiers:120 notiers2:80; do
  t=${v%%:*}
  step ${v#*:} steps_$t python3 bench/hybrid_steps.py --num-requests 16 --prompt-len 2048 \
    --new-tokens 64 --max-model-len 131072 --profile "" --small "" \
    $([ "${t%2}" = notiers ] && echo --no-tiers) --out "$W/steps_$t.json"
  grep -E "engine built|warm run|decode steps" "$W/steps_$t.log"
done
gpu_tests suite 330 14 tests
