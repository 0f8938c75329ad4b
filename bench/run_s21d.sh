#!/usr/bin/env bash
# Session 21, call D: a register cap on the dense decode kernel (Triton's maxnreg). On sm_90
# the fp8 mode-2 launch (64, 2, 3) takes 232 registers (4 programs an SM); capped at 168 it
# spills 24 bytes and 6 fit (bench/decode_kernel_regs.py-style compile here). Per call at
# 32 x 8K and 64 x 320 (the short workload's decode) with caps 168 / 128 and the split sweep,
# then the long workload's fp8 engine with KVPLAN_DECODE_MAXNREG=0 / 168 in one call.
set -u
BUDGET=${BUDGET:-500}
source bench/gpu_steps.sh
step 60 cap_test python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf -k "register_cap or maxnreg" tests/ops
tail -3 "$W/cap_test.log"
step 150 cap_long python3 bench/bench_quant_decode.py --graph --formats fp8,bf16,fp4,int8 --no-tiling --maxnreg 168,128 --splits 2,3,4,6 --out "$W/cap_long.json"
grep -E "^  |^ *(fp8|bf16|fp4|int8) " "$W/cap_long.log" | head -60
step 90 cap_short python3 bench/bench_quant_decode.py --graph --formats fp8,bf16 --no-tiling --maxnreg 168,128 --splits 1,2,4 --batch 64 --context 320 --out "$W/cap_short.json"
grep -E "^  |^ *(fp8|bf16) " "$W/cap_short.log" | head -30
for r in 0 168; do
  KVPLAN_DECODE_MAXNREG=$r step 45 long_fp8_cap$r python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_cap$r.json"
  grep -E "kvplan \(|decode step" "$W/long_fp8_cap$r.log"
done
