#!/usr/bin/env bash
# Session 47, call A: kv_exact_window with every query bounded by its own window in long
# chunks too (the per-step ring, the prefill kernel's ring range from the row tile's own
# bound): the GPU tests of the window, the ring kernels, the quantized engine and the graphs;
# one 8K prompt's prefill (fp8 with SDPA over stored rows, fp8 on the paged kernel, fp8 with a
# 64-token window); the long and short fp8 workloads with windows 0 and 64.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 170 4 -rP tests/engine/test_kv_exact_window.py tests/ops/test_paged_attention_ring.py \
  tests/engine/test_quantized_kv_engine.py tests/engine/test_cuda_graphs.py
grep -E "^chunk " "$W/tests.log"
step 100 prefill python3 bench/profile_prefill.py --prompt-len 8192 --prompts 3 \
  --variants fp8,fp8-paged,fp8-w64 --out "$W/prefill.json"
grep -E "ms per" "$W/prefill.log"
for w in 0 64; do
  step 60 "long_w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_w$w.json"
  grep -E "kvplan \(|decode step" "$W/long_w$w.log"
done
for w in 0 64; do
  step 40 "short_w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --hf "" --out "$W/short_w$w.json"
  grep -E "kvplan \(|decode step" "$W/short_w$w.log"
done
