#!/usr/bin/env bash
# Session 18, call B: the weight-streaming small-M GEMM (`kvplan.ops.small_gemm`): GPU tests,
# the per-shape sweep against cuBLAS, then the engines with it on / off (KVPLAN_SMALL_GEMM=0).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_small_gemm.py tests/engine tests/models/test_fused_gpu.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 150 sweep_dense python3 bench/bench_small_gemm.py --shapes 64,3072,2048,qkv 64,2048,2048,o 64,16384,2048,gate_up 64,2048,8192,down 64,128256,2048,lm_head --out "$W/sweep_dense.json"
grep -vE "^\s*$" "$W/sweep_dense.log" | head -30
step 45 short_bf16_on python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_on.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_on.log"
step 45 short_bf16_off env KVPLAN_SMALL_GEMM=0 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_off.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_off.log"
step 45 short_fp8_on python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_on.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_on.log"
step 45 hyb_on python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_on.json"
grep -E "fp8 |async" "$W/hyb_on.log"
step 45 hyb_off env KVPLAN_SMALL_GEMM=0 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_off.json"
grep -E "fp8 |async" "$W/hyb_off.log"
step 120 sweep_hyb python3 bench/bench_small_gemm.py --shapes 32,2048,2048,h2k 32,12288,512,q_res 32,2048,8192,o_b 32,4096,2048,x_proj 32,129280,2048,head --out "$W/sweep_hyb.json"
grep -vE "^\s*$" "$W/sweep_hyb.log" | head -30
