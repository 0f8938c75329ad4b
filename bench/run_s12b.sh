#!/usr/bin/env bash
# Second call: the whole GPU suite (session 11's run found only the prefetch tests failing),
# the prompt-shaped indexer scores per sequence vs per row, the decode kernels alone (fp4
# now prefetches by default and folds e2m1's 2^14 into its scales), the short dense workload
# bf16 vs fp8 vs fp4.
set -u
source bench/gpu_steps.sh
step 220 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=line -rf tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12
step 60 index_prompt python3 bench/bench_sparse_kernels.py --only index_prompt --out "$W/index_prompt.json"
grep -E "FASTEST|old|new  " "$W/index_prompt.log" | tail -6
step 50 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --prefetch --no-tiling --out "$W/quant_decode.json"
grep -E "^ +(bf16|fp8|fp4) " "$W/quant_decode.log" | tail -8
for f in bf16 fp8 fp4; do
  step 55 short_$f python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_$f.json"
  grep -E "kvplan \(|decode step" "$W/short_$f.log"
done
