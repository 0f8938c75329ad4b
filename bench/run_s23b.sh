#!/usr/bin/env bash
# Session 23, call B: the fp16-tile defaults (KVPLAN_FP4_F16 / KVPLAN_SPARSE_FP4_F16 now on;
# fp4 pages read as fp16 tiles decode in mode 2 under a 128-register cap, so 8 programs an SM
# and 4 splits at 32 x 8K). Call A measured them off by default (bench/RESULTS.md, session 23).
# 1. The whole GPU suite with the new defaults.
# 2. fp4 per call, 32 x 8K: the new default, the bf16 tiles (the old default), fp8 beside.
# 3. Hybrid decode with fp4 records, sparse fp16 tiles off / on, fp8 beside (32K, batch 32).
# 4. The long workload: fp4 (new default) and fp8.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 280 gpu_suite python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf --durations=10 tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -30
step 50 fp4_b32 python3 bench/bench_quant_decode.py --graph --formats fp4,fp8 --no-tiling --fp4-f16 --splits "" --out "$W/fp4_b32.json"
grep -E "^  " "$W/fp4_b32.log"
for f in 0 1; do
  KVPLAN_SPARSE_FP4_F16=$f step 40 hybrid_fp4_f16$f python3 bench/bench_hybrid.py --contexts 32768 --formats fp4$([ $f = 1 ] && echo ,fp8) --out "$W/hybrid_fp4_f16$f.json"
  grep -E "^ *(fp4|fp8) .*(graphs|async)|^ +async" "$W/hybrid_fp4_f16$f.log"
done
long() {  # name, format
  local name=$1 fmt=$2
  step 55 $name python3 bench/bench_engine.py --kv-format $fmt --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/$name.json"
  grep -E "kvplan \(|decode step" "$W/$name.log"
}
long long_fp4 fp4
long long_fp8 fp8
