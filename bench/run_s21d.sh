#!/usr/bin/env bash
# Session 21, call D: two launch-level changes for the decode steps.
# 1. A register cap on the dense decode kernel (Triton's maxnreg): the fp8 mode-2 launch
#    (64, 2, 3) takes 232 registers (4 programs an SM); capped at 168 it spills 24 bytes and
#    6 fit.
# 2. Programmatic dependent launch (KVPLAN_PDL=2) of the decode steps' Triton kernels (dense:
#    RMSNorm, qkv epilogue, attention + combine, silu-mul, LM head, argmax; hybrid: norms,
#    RoPE, hc, indexer, top-k, sparse attention, stores, MoE routing / SwiGLU / sums).
# GPU tests under PDL first, then A/B runs side by side.
set -u
BUDGET=${BUDGET:-480}
source bench/gpu_steps.sh
KVPLAN_PDL=2 step 110 gpu_tests python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --tb=short -rf -k "register_cap or graph or fused or argmax or small_gemm or decode or hybrid or deepseek or sparse or topk" tests/ops tests/models tests/engine
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
for p in 0 2; do
  KVPLAN_PDL=$p step 45 short_bf16_pdl$p python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_pdl$p.json"
  grep -E "kvplan \(|decode step" "$W/short_bf16_pdl$p.log"
  KVPLAN_PDL=$p step 40 hybrid_pdl$p python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hybrid_pdl$p.json"
  grep -E "^ *(fp8|exact) .*(graphs|async)|^ +async" "$W/hybrid_pdl$p.log"
done
step 90 cap_long python3 bench/bench_quant_decode.py --graph --formats fp8,fp4,bf16 --no-tiling --maxnreg 168,128 --splits 2,3,4 --out "$W/cap_long.json"
grep -E "^  |^ *(fp8|bf16|fp4) " "$W/cap_long.log" | head -40
KVPLAN_DECODE_MAXNREG=168 step 45 long_fp8_cap168 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_cap168.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_cap168.log"
