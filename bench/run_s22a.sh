#!/usr/bin/env bash
# Prepared in session 21 for the next session's first call (session 21 ran out of device
# time before its call F). In order:
# 1. The GPU suite: session 21 added the fp8 decode register cap as a default
#    (`_decode_launch_plan`), the PDL switch (off), and two fused merges (off):
#    KVPLAN_DECODE_FUSED_COMBINE / KVPLAN_SPARSE_FUSED_COMBINE, with GPU tests.
# 2. The fp8 cap plan per call at 32 x 8K and 16 x 8K against the uncapped plan, int8 too.
# 3. Long fp8 workload: the default (cap + 3 splits) vs KVPLAN_DECODE_MAXNREG=0, and with the
#    dense fused merge; bf16 beside them.
# 4. Hybrid decode, batch 32, 32K / 128K: fp8 with and without the fused sparse merge.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 230 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
step 40 plan_b32 python3 bench/bench_quant_decode.py --graph --formats fp8,int8 --no-tiling --maxnreg 0,168 --with-splits 2,3 --splits "" --batch 32 --out "$W/plan_b32.json"
grep -E "^  " "$W/plan_b32.log"
step 25 plan_b16 python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --maxnreg 0 --with-splits 3,6 --splits "" --batch 16 --out "$W/plan_b16.json"
grep -E "^  " "$W/plan_b16.log"
long() {  # name, then env assignments (FMT: the cache format, fp8 by default)
  local name=$1; shift
  env "$@" timeout 48 python3 bench/bench_engine.py --kv-format ${FMT:-fp8} --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "kvplan \(|decode step" "$W/$name.log"; tar czf "$O/logs.tgz" -C "$W" .
}
long long_fp8_default KVPLAN_DECODE_MAXNREG=
long long_fp8_uncapped KVPLAN_DECODE_MAXNREG=0
long long_fp8_fused KVPLAN_DECODE_FUSED_COMBINE=1
FMT=bf16 long long_bf16 KVPLAN_DECODE_MAXNREG=
for f in 0 1; do
  KVPLAN_SPARSE_FUSED_COMBINE=$f step 40 hybrid_fused$f python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8 --out "$W/hybrid_fused$f.json"
  grep -E "^ *(fp8|exact) .*(graphs|async)|^ +async" "$W/hybrid_fused$f.log"
done
