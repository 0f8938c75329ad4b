#!/usr/bin/env bash
# Prepared in session 29: the whole GPU suite at session 29's last code (its own call: on a
# fresh machine Triton compiles first and the suite needs ~330-370 s).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 540 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
