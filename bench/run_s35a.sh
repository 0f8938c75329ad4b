#!/usr/bin/env bash
# Session 35, call A: the whole GPU suite at the code of sessions 33-34 (session 33's review
# and session 34's MoE size rule, `DeepseekV4MoE.dense_size`, never ran on a GPU), then
# the reference decode steps on this device: DeepSeek-V4-shaped 32K x 32, fp8 against bf16 rows.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$W/gpu.txt"
step 430 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -14
step 100 p32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8,exact \
  --out "$W/p32k.json"
grep -E "^ *(fp8|exact) |async|floor" "$W/p32k.log" | head -12
