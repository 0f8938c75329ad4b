#!/usr/bin/env bash
# Session 30, call D: the whole GPU suite at the session's last kernel change (the sparse
# kernels' slot counts unspecialized; every CUDA engine warming up), then where the host time
# of the DeepSeek-V4 workload's eager steps goes now (cProfile; session 28's profile predates
# the lean launches and the cheaper argument checks).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 430 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
step 130 steps_cprofile python3 bench/hybrid_steps.py --profile cprofile --top 80 --small 8 \
  --out "$W/steps_cprofile.json"
grep -E "^engine|^step|^one|median" "$W/steps_cprofile.log" | head -20
