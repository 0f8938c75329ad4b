#!/usr/bin/env bash
# Session 7's first GPU call: every GPU test, then the hybrid decode step, the kvplan side of
# the HF comparison, the dense bf16 / fp8 / int8 A/B and the new kernels' microbenchmarks,
# under a wall-time budget (later steps skip when it is gone; BUDGET=seconds).
set -u
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
step ${T_TESTS:-220} gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_tests.log" | tail -15
step 80 hybrid python3 bench/bench_hybrid.py --modes graphs --profile 1 --out "$W/hybrid.json"
grep -E "^ +(fp8|exact|bf16) |Error" "$W/hybrid.log"
step 80 hybrid_hf python3 bench/bench_hybrid_hf.py --no-hf --out "$W/hybrid_hf.json"
grep -E "kvplan|Error" "$W/hybrid_hf.log" | tail -3
for f in bf16 fp8 int8; do
  step 45 "engine_$f" python3 bench/bench_engine.py --hf '' --kv-format $f --out "$W/engine_$f.json"
  grep -iE "tok/s|Error" "$W/engine_$f.log" | tail -2
done
for b in sparse_kernels compress_store dsv4_blocks moe_grouped; do
  step 60 "$b" python3 "bench/bench_$b.py" --out "$W/$b.json"
  tail -4 "$W/$b.log"
done
