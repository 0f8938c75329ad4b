#!/usr/bin/env bash
# Fourth call: where the 128K decode step goes at batch 256 (fp8 15.4 ms vs exact 12.8 ms in
# call 1: fp8 slower where its floor is 1.6x lower) and at batch 32, kernel tables per format.
set -u
source bench/gpu_steps.sh
step 120 prof_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --profile 1 --out "$W/prof_b256.json"
grep -E "131072|ALL KERNELS" "$W/prof_b256.log" | tail -6
step 90 prof_b32 python3 bench/bench_hybrid.py --contexts 131072 --formats fp8,exact --profile 1 --out "$W/prof_b32.json"
grep -E "131072|ALL KERNELS" "$W/prof_b32.log" | tail -6
