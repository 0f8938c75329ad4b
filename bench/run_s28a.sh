#!/usr/bin/env bash
# Prepared in session 27 for the next session's first call: the whole GPU suite (session 27
# ended with 496 passed; JSON mode's CUDA test was written after the device time was spent),
# then the prompt range kernel's cases again and the long dense workload's fp8 run.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 400 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
step 80 ranges python3 bench/bench_prompt_ranges.py --out "$W/ranges.json"
grep -vE "^\s*$" "$W/ranges.log" | cut -c1-300
long_run long_fp8 fp8
