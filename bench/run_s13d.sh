#!/usr/bin/env bash
# Session 13, fourth device call: the whole GPU suite after the top-k fix (the third call's
# suite ran out of time with failures it could not name).
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
step 320 gpu_suite python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=line -rf tests
grep -E "passed|failed|^FAILED|^E |^/.*Error" "$W/gpu_suite.log" | head -40
