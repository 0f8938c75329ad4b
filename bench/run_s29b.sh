#!/usr/bin/env bash
# Session 29, call B: kvplan's lean Triton launches (kvplan/ops/_launch.py) -- their tests, the
# host cost a launch, the DeepSeek-V4 workload's eager steps with the lean path off / on in one
# process, then the whole GPU suite with it on (every kernel launch goes through it).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 60 lean_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
  tests/ops/test_lean_launch.py tests/models/test_deepseek_v4_fused_norm.py \
  tests/backends/test_backends_device_expand.py
tail -3 "$W/lean_tests.log"
step 40 launch python3 bench/triton_launch_cost.py --out "$W/launch.json"
tail -4 "$W/launch.log"
step 150 steps_ab python3 bench/hybrid_steps.py --profile "" --small "" --lean-ab 3 \
  --out "$W/steps_ab.json"
grep -E "^step|^decode|^lean|^warm" "$W/steps_ab.log"
step 330 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
