#!/usr/bin/env bash
# Session 19, call B: the scaled-dot decode path (fp16 tiles of quantized pages, the scales on
# the dot products; KVPLAN_SCALED_DOTS=0 is the former bf16-tile path) -- GPU tests of the
# paged kernels, then per-call decode times on and off (64 x 320 and 32 x 8K, graphs), a
# tiling sweep of fp8 with it, and the long workload's decode step (fp8 on / off, bf16).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 120 gpu_paged python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/ops/test_paged_attention.py tests/ops/test_paged_decode_regs.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_paged.log" | head -20
for sd in 1 0; do
  step 40 dec320_sd$sd env KVPLAN_SCALED_DOTS=$sd python3 bench/bench_quant_decode.py --batch 64 --context 320 --formats bf16,fp8,int8,fp4 --graph --no-tiling --splits 1 --out "$W/dec320_sd$sd.json"
  grep -A6 "^format" "$W/dec320_sd$sd.log"
  step 40 dec8k_sd$sd env KVPLAN_SCALED_DOTS=$sd python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats bf16,fp8,int8,fp4 --graph --no-tiling --splits 1 --out "$W/dec8k_sd$sd.json"
  grep -A6 "^format" "$W/dec8k_sd$sd.log"
done
step 60 dec8k_sweep python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats fp8,fp4 --graph --splits 1 --tiles 32,64 --warps 2,4 --stages 2,3,4 --out "$W/dec8k_sweep.json"
grep -A6 "^format" "$W/dec8k_sweep.log"
step 75 long_fp8_sd1 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_sd1.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_sd1.log"
step 75 long_fp8_sd0 env KVPLAN_SCALED_DOTS=0 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_sd0.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_sd0.log"
step 75 long_bf16 python3 bench/bench_engine.py --kv-format bf16 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_bf16.json"
grep -E "kvplan \(|decode step" "$W/long_bf16.log"
