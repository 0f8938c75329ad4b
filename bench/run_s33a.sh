#!/usr/bin/env bash
# Session 33, call A: where today's decode steps spend device time (fresh kernel tables).
# DeepSeek-V4-shaped model: 32K x 32 and 128K x 256, fp8 records against bf16 rows, profiled;
# dense llama-1b decode graph at batch 64 (profile_engine.py), bf16 and fp8.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
step 110 p32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8,exact \
  --profile 2 --out "$W/p32k.json"
grep -E "^ *(fp8|exact) |async" "$W/p32k.log"
step 150 p128k python3 bench/bench_hybrid.py --batch 256 --contexts 131072 --formats fp8,exact \
  --profile 2 --out "$W/p128k.json"
grep -E "^ *(fp8|exact) |async" "$W/p128k.log"
for f in bf16 fp8; do
  step 60 dense_$f python3 bench/profile_engine.py --kv-format $f --out "$W/dense_$f"
  tail -40 "$W/dense_$f.log"
done
