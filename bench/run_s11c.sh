#!/usr/bin/env bash
# Session 11: the 32 x 8K x 256 workload (bench_engine's long run) under the profiler per KV
# format, stored-rows fresh path on / off, and fp4 with the prefetching decode kernel; then
# single 8K prompts again with the prefetch variants.
set -u
source bench/gpu_steps.sh
step 300 workload python3 bench/profile_prefill.py --workload 32,256 --top 20 --variants bf16,fp8,fp8-paged,fp4,fp4-paged,fp4+prefetch,fp4-paged+prefetch --out "$W/workload.json"
grep -v "^kvplan:" "$W/workload.log" | grep -v -i warn
