#!/usr/bin/env bash
# Prepared in session 18 (not run: its device time ran out). For session 19's first call:
# the whole GPU suite with session 18's defaults (decode tilings bf16 (64, 2, 5) / fp8
# (64, 2, 3), the LM-head GEMM, 16-row hc tiles up to 256 rows), then the dense engine's bf16
# decode step with the new tiling against (64, 2, 2) and the former (64, 4, 5), side by side,
# and int8 / fp4 decode tilings at the engine's two shapes.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 300 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
for t in default 64,2,2 64,4,5; do
  if [ "$t" = default ]; then pre=(); else pre=(env KVPLAN_DECODE_TILING=$t); fi
  step 40 short_bf16_${t//,/_} "${pre[@]}" python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_${t//,/_}.json"
  grep -E "kvplan \(|decode step" "$W/short_bf16_${t//,/_}.log"
done
step 60 dec_q320 python3 bench/bench_quant_decode.py --batch 64 --context 320 --formats int8,fp4 --graph --splits 1 --tiles 32,64 --warps 2,4 --stages 2,3,5 --out "$W/dec_q320.json"
grep -A6 "^format" "$W/dec_q320.log"
step 60 dec_q8k python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats int8,fp4 --graph --splits 1 --tiles 32,64 --warps 2,4 --stages 2,3,5 --out "$W/dec_q8k.json"
grep -A6 "^format" "$W/dec_q8k.log"
