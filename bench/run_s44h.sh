#!/usr/bin/env bash
# Session 44, call H: the ring's one-launch Triton store on the GPU (its tests), then where the
# window's decode cost goes: profiled fp8 decode graphs without and with a 64-position window,
# at 64 x 256 and at 32 x 8,192.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 120 8 tests/engine/test_kv_exact_window.py tests/engine/test_quantized_kv_engine.py
for shape in "64 256" "32 8192"; do
  set -- $shape
  for w in 0 64; do
    step 75 "p_${1}x${2}_w$w" python3 bench/profile_engine.py --kv-format fp8 --kv-exact-window "$w" \
      --num-requests "$1" --prompt-len "$2" --replays 10 --steps 10 --out "$W"
    grep -E "kernel time per step|replay wall" "$W/p_${1}x${2}_w$w.log"
    grep -E "^ +[0-9.]+ +[0-9.]+ +[0-9.]+%" "$W/p_${1}x${2}_w$w.log" | head -12
  done
done
