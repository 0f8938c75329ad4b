#!/usr/bin/env bash
# Session 29, call C: the lean launches after call B's fixes (the test's FMA rounding, the
# device / stream queries), the whole GPU suite with them on, the eager-step A/B again.
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 50 lean_tests python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
  tests/ops/test_lean_launch.py tests/backends/test_backends_device_expand.py \
  tests/models/test_deepseek_v4_fused_norm.py
tail -3 "$W/lean_tests.log"
step 30 launch python3 bench/triton_launch_cost.py --out "$W/launch.json"
tail -4 "$W/launch.log"
step 400 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
step 120 steps_ab python3 bench/hybrid_steps.py --profile "" --small "" --lean-ab 2 \
  --out "$W/steps_ab.json"
grep -E "^lean|^warm" "$W/steps_ab.log"
