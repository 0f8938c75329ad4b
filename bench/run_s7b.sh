#!/usr/bin/env bash
# Session 7's second GPU call: the fp8/int8 in-place page mismatch, the hybrid decode profile
# at 32K, kvplan vs HF end to end, the dense long-context quantized A/B; all logs in one tarball.
set -u
source bench/gpu_steps.sh
step 40 dbg_quant python3 bench/dbg/quant_pages.py
cat "$W/dbg_quant.log" | grep -v "^\[" | tail -12
step 60 hybrid32k python3 bench/bench_hybrid.py --modes graphs --profile 1 --contexts 32768 --out "$W/hybrid32k.json"
step 330 hybrid_hf python3 bench/bench_hybrid_hf.py --out "$W/hybrid_hf.json"
grep -E "tok/s|kvplan|HF|Error" "$W/hybrid_hf.log" | tail -8
for f in bf16 fp8 fp4 int8; do
  step 70 "long_$f" python3 bench/bench_engine.py --hf '' --kv-format $f --num-requests 32 \
    --prompt-len 8192 --new-tokens 256 --out "$W/long_$f.json"
  grep -E "^kvplan" "$W/long_$f.log" | tail -1
done
