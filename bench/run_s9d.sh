#!/usr/bin/env bash
# Prepared at the end of session 8: the whole GPU suite with room to finish (it needed more
# than 200 s with 8 workers), failing names as they happen and the slowest tests at the end.
set -u
source bench/gpu_steps.sh
step 420 gpu_suite python3 -m pytest -v -m gpu -n 12 -p no:cacheprovider --tb=short --durations=25 tests
grep -E "FAILED|ERROR" "$W/gpu_suite.log" | grep -v PASSED | head -20
grep -E "passed|failed" "$W/gpu_suite.log" | tail -2; grep -A27 "slowest" "$W/gpu_suite.log" | head -28
