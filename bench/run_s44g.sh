#!/usr/bin/env bash
# Session 44, call G: a fresh prompt's rows over SDPA with the ring's exact tail (instead of the
# paged kernel while kv_exact_window is on): its GPU tests, then the dense engine's speed with and
# without a 64-position window on fp8, both workloads, alternating on one machine.
set -u
BUDGET=${BUDGET:-520}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 150 8 tests/engine/test_kv_exact_window.py tests/backends/test_sdpa_prefill.py
for w in 0 64; do
  step 45 "s_w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --hf "" --out "$W/s_w$w.json"
  grep -E "kvplan \(|decode step" "$W/s_w$w.log"
done
for w in 0 64 0 64; do
  n=$((${n:-0} + 1))
  step 70 "l_w${w}_$n" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/l_w${w}_$n.json"
  grep -E "kvplan \(|decode step" "$W/l_w${w}_$n.log"
done
