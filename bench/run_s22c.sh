#!/usr/bin/env bash
# Session 22, call C: the defaults after calls A / B (the dense fused merge removed, the
# sparse fused merge on, int8's decode plan at 6 programs an SM). In order:
# 1. The whole GPU suite.
# 2. Hybrid decode, batch 32, fp8 records and bf16 rows side by side at 4K / 32K / 128K.
# 3. The long dense workload (32 x 8,192 x 256) per format: fp8, bf16, int8, fp4.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 300 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
step 75 hybrid python3 bench/bench_hybrid.py --contexts 4096,32768,131072 --formats fp8,exact --out "$W/hybrid.json"
grep -E "^ *(fp8|exact) |^ +async|bytes/token|max batch" "$W/hybrid.log"
for f in fp8 bf16 int8 fp4; do
  step 45 long_$f python3 bench/bench_engine.py --kv-format $f --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_$f.json"
  grep -E "kvplan \(|decode step" "$W/long_$f.log"
done
