#!/usr/bin/env bash
# Session 27, call E: the whole GPU suite at the session's last code state (the prompt range
# path on by default, the shared softmax step in the index kernels), then index tables vs
# ranges once more after that refactor (no sweep).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 420 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -15
step 100 ranges python3 bench/bench_prompt_ranges.py --out "$W/ranges.json"
grep -vE "^\s*$" "$W/ranges.log" | cut -c1-400
