#!/usr/bin/env bash
# Session 27, call F: the hybrid workload side by side with Hugging Face in one run (HF's
# best of 2, kvplan fp8 with the prompt range path on by default).
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
step 290 e2e_hf python3 bench/bench_hybrid_hf.py --kv-formats fp8 --out "$W/e2e_hf.json"
grep -E "^ *(kvplan|hf|HF)|speedup|x HF" "$W/e2e_hf.log" | tail -8
