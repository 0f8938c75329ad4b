#!/usr/bin/env bash
# (The E4M3_F16K path it measures was reverted after this call: commit 53f5dcc holds it.)
# Session 49, call B: fp8 decode with K read as fp16 tiles (E4M3_F16K, KVPLAN_FP8_F16_KEYS=1:
# each key's codes times its scales over its largest one, in fp16; that largest scale on the
# key's logit) against today's bf16 tiles. sm_90 main loop (compiled on the CPU): 1,047
# against 1,139 instructions at the default long-context launch (32 keys x 2 warps x 3 stages,
# two KV heads a program, 168 registers), 831 against 910 at (64, 2, 3), one head.
# GPU tests of the new path; the kernel alone at 32 x 8K and 64 x 320 with the flag off / on,
# alternating; the short and long fp8 workloads off / on.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 110 8 tests/ops/test_paged_attention_quantized.py \
  tests/engine/test_quantized_kv_engine.py
for i in 1 2; do
  for f in 0 1; do
    step 50 "q8k_k${f}_$i" env KVPLAN_FP8_F16_KEYS=$f python3 bench/bench_quant_decode.py \
      --graph --formats fp8 --no-tiling --splits 4,6 --out "$W/q8k_k${f}_$i.json"
    grep -E " us$" "$W/q8k_k${f}_$i.log" | head -8
  done
done
for f in 0 1; do
  step 40 "q320_k$f" env KVPLAN_FP8_F16_KEYS=$f python3 bench/bench_quant_decode.py --graph \
    --formats fp8 --batch 64 --context 320 --no-tiling --splits 1 --out "$W/q320_k$f.json"
  grep -E " us$" "$W/q320_k$f.log" | head -6
done
long_run l_k0 fp8 KVPLAN_FP8_F16_KEYS=0
long_run l_k1 fp8 KVPLAN_FP8_F16_KEYS=1
short_run s_k0 fp8 KVPLAN_FP8_F16_KEYS=0
short_run s_k1 fp8 KVPLAN_FP8_F16_KEYS=1
