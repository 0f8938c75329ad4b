#!/usr/bin/env bash
# Session 44, call E: kv_exact_window with CUDA graphs (the ring's step arrays in persistent
# buffers; padding rows of a bucket read no ring key): the ring's GPU tests and the quantized
# engine's graph-vs-eager tests, then the dense engine's speed with and without a 64-position
# window on fp8 (64 x 256 x 128 twice, alternating; 32 x 8,192 x 256 once each).
set -u
BUDGET=${BUDGET:-480}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 200 8 tests/engine/test_kv_exact_window.py tests/engine/test_quantized_kv_engine.py \
  tests/ops/test_paged_attention_ring.py
for r in 1 2; do
  for w in 0 64; do
    step 45 "s_w${w}_r$r" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
      --hf "" --out "$W/s_w${w}_r$r.json"
    grep -E "kvplan \(|decode step" "$W/s_w${w}_r$r.log"
  done
done
for w in 0 64; do
  step 70 "l_w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/l_w$w.json"
  grep -E "kvplan \(|decode step" "$W/l_w$w.log"
done
