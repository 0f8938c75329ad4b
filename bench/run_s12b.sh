#!/usr/bin/env bash
# Second call: the whole GPU suite (session 11's run found only the prefetch tests failing),
# the short dense workload bf16 vs fp8 vs fp4 (fp4 decode now prefetches by default and folds
# e2m1's 2^14 into its scales), the decode kernels alone, and the long fp4 workload.
set -u
source bench/gpu_steps.sh
step 250 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=line -rf tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12
for f in bf16 fp8 fp4; do
  step 60 short_$f python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_$f.json"
  grep -E "kvplan \(|decode step" "$W/short_$f.log"
done
step 60 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --prefetch --no-tiling --out "$W/quant_decode.json"
grep -E "^ +(bf16|fp8|fp4) " "$W/quant_decode.log" | tail -8
step 100 long_fp4 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4.json"
grep -E "kvplan \(|decode step|compiles" "$W/long_fp4.log"
