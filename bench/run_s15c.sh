#!/usr/bin/env bash
# Session 15, call C: the whole GPU test suite after this session's changes, then the dense
# engine's KV formats side by side (issue 17): the short workload bf16 / fp8 with the fused
# quantized store and fp8 with it switched off (KVPLAN_FUSED_KV_STORE=0), and the long
# workload (32 x 8,192 x 256) bf16 / fp8 / fp4.
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 230 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 40 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
grep -E "kvplan \(|decode step" "$W/short_bf16.log"
step 40 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 40 short_fp8_off env KVPLAN_FUSED_KV_STORE=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_off.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_off.log"
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
grep -E "kvplan \(|decode step" "$W/long_fp8.log"
step 85 long_bf16 python3 bench/bench_engine.py --kv-format bf16 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_bf16.json"
grep -E "kvplan \(|decode step" "$W/long_bf16.log"
step 85 long_fp4 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4.json"
grep -E "kvplan \(|decode step" "$W/long_fp4.log"
