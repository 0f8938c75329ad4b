#!/usr/bin/env bash
# Prepared in session 26 for the next session's first call: the whole GPU suite with room to
# finish (session 26's call E ran ~491 of ~496 tests, all passing, before its 290 s ran out),
# then the long workload's formats side by side again (bf16 / fp8 / fp4: session 26 had fp4
# at 1.007x fp8, session 24 at 0.978x; a second run says whether fp4 >= fp8 holds).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 400 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf --durations=30 tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12; grep -A32 "slowest" "$W/gpu_suite.log" | head -34
for f in fp8 fp4; do long_run "long_$f" $f; done
