#!/usr/bin/env bash
# Session 11: why the 32 x 8K fp8 workload fell from 2,533 to 1,702 tok/s (run_s10b): one
# 8K prompt's prefill per KV format, with the stored-rows fresh path on and off.
set -u
source bench/gpu_steps.sh
step 200 prefill python3 bench/profile_prefill.py --variants bf16,fp8,fp8-paged,fp4,fp4-paged --out "$W/prefill.json"
cat "$W/prefill.log" | grep -v "^kvplan:"
