#!/usr/bin/env bash
# Session 24, call E. Call D's 8,192-token prefill took 45.2 ms a prompt against 34.6 ms of
# kernels (bf16): where do the other ~10 ms go? And the GPU tests of every fp4 path with the
# nibble-order tiles now the default.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
step 100 prefill_host python3 bench/profile_prefill.py --variants bf16,fp8 --prompts 3 --top 25 --host --out "$W/prefill_host.json"
grep -vE "Warning|warn" "$W/prefill_host.log" | head -80
step 170 gpu_fp4 python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf -k "fp4 or nib or e2m1" tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_fp4.log" | head -20
