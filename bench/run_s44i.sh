#!/usr/bin/env bash
# Session 44, call I: the ring's keys in their own decode launch (RING 3) and the pages' programs
# without ring code (RING 2): the ring's GPU tests, then profiled fp8 decode graphs with a
# 64-position window (32 x 8,192 and 64 x 256) and the 32 x 8,192 baseline on the same machine.
set -u
BUDGET=${BUDGET:-235}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 90 8 tests/ops/test_paged_attention_ring.py tests/engine/test_kv_exact_window.py \
  tests/engine/test_quantized_kv_engine.py
for spec in "32 8192 64" "32 8192 0" "64 256 64"; do
  set -- $spec
  step 50 "p_${1}x${2}_w$3" python3 bench/profile_engine.py --kv-format fp8 --kv-exact-window "$3" \
    --num-requests "$1" --prompt-len "$2" --replays 10 --steps 5 --out "$W"
  grep -E "kernel time per step|replay wall|_decode_kernel|ring_store|_combine" "$W/p_${1}x${2}_w$3.log"
done
