#!/usr/bin/env bash
# Session 21, call B: where the hybrid decode step (batch 32, 32K / 128K, fp8 and bf16 rows)
# and the dense decode graph (llama-1b, batch 64, bf16 / fp8) spend their GPU time now.
set -u
BUDGET=${BUDGET:-400}
source bench/gpu_steps.sh
step 200 hybrid_prof python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --profile 2 --out "$W/hybrid_prof.json"
tail -80 "$W/hybrid_prof.log"
for f in bf16 fp8; do
  step 70 prof_$f python3 bench/profile_engine.py --kv-format $f --out "$W/prof_$f"
  head -16 "$W/prof_$f"/*.txt 2>/dev/null || tail -20 "$W/prof_$f.log"
done
