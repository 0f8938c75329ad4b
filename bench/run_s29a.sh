#!/usr/bin/env bash
# Prepared in session 28 for the next session's first call: the whole GPU suite (session 28's
# call E cut it at 290 s on a fresh machine: ~499 results, no failure, one test still running),
# Triton's host cost a launch (the eager DeepSeek-V4 step's largest host item), the workload's
# eager steps again after session 28's host changes.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 380 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
step 40 launch python3 bench/triton_launch_cost.py --out "$W/launch.json"
cat "$W/launch.log" | tail -4
step 120 steps python3 bench/hybrid_steps.py --profile cprofile --top 200 --small 8,64 \
  --out "$W/steps.json"
grep -vE "USDT|^\s*$|Writing" "$W/steps.log" | cut -c1-240 | tail -14
# session 28's untimed switch: the blocks' input norms inside the hyper-connection kernels
for f in 0 1; do
  step 35 fnorm$f env KVPLAN_HC_FUSED_NORM=$f python3 bench/bench_hybrid.py --batch 16 \
    --contexts 4096 --formats fp8 --out "$W/fnorm$f.json"
  grep -E "^ *fp8 |async" "$W/fnorm$f.log"
done
