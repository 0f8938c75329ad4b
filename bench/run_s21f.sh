#!/usr/bin/env bash
# Session 21, call F: fp8 decode's register cap as a default (DECODE_MAXNREG["e4m3"] = 168,
# taken where it brings more splits: `_decode_launch_plan`). Per call at 32 x 8K and 16 x 8K
# against the uncapped plan ({'maxnreg': 0}), then the long fp8 workload with the default and
# with KVPLAN_DECODE_MAXNREG=0 in one call; GPU tests of the paged decode first.
set -u
BUDGET=${BUDGET:-235}
source bench/gpu_steps.sh
step 60 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf -k "register_cap or decode or quantized_pages or prefetch" tests/ops
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 40 plan_b32 python3 bench/bench_quant_decode.py --graph --formats fp8,int8 --no-tiling --maxnreg 0,168 --with-splits 2,3 --splits "" --batch 32 --out "$W/plan_b32.json"
grep -E "^  " "$W/plan_b32.log"
step 25 plan_b16 python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --maxnreg 0 --with-splits 3,6 --splits "" --batch 16 --out "$W/plan_b16.json"
grep -E "^  " "$W/plan_b16.log"
for r in default 0; do
  if [ $r = default ]; then unset KVPLAN_DECODE_MAXNREG; else export KVPLAN_DECODE_MAXNREG=0; fi
  step 48 long_fp8_$r python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_$r.json"
  grep -E "kvplan \(|decode step" "$W/long_fp8_$r.log"
done
