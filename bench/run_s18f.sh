#!/usr/bin/env bash
# Session 18, call F: the long workload with fp8 pages, decode tiling 2 warps / 3 stages (call E:
# 156.7 vs 176.0 us a call at 32 x 8K) against the default 4 / 2, side by side.
set -u
BUDGET=${BUDGET:-150}
source bench/gpu_steps.sh
step 70 long_fp8_t223 env KVPLAN_DECODE_TILING=64,2,3 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_t223.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_t223.log"
step 70 long_fp8_dflt python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_dflt.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_dflt.log"
