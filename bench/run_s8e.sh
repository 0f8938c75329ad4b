#!/usr/bin/env bash
# Session 8, fifth GPU call: the fused hyper-connection GPU test after its tolerance fix.
set -u
source bench/gpu_steps.sh
step 60 gpu_tests python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider --tb=short -rf tests/ops/test_hyper_connection_fused.py
grep -E "passed|failed|^FAILED|^E  " "$W/gpu_tests.log" | head -16
