#!/usr/bin/env bash
# Session 45, call F: the recent-window ring bounded per query (verification steps read each
# query's own window; the Triton prefill kernel reads the straddling keys from pages and ring
# under complementary masks): the ring's GPU tests, then the fp8 decode graph with and without
# a 64-position window at 64 x 256 (the decode kernel's one new max).
set -u
BUDGET=${BUDGET:-200}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 130 8 tests/ops/test_paged_attention_ring.py tests/engine/test_kv_exact_window.py \
  tests/engine/test_quantized_kv_engine.py tests/engine/test_cuda_graphs.py \
  tests/backends/test_fresh_prefill_gpu.py
grep -E "passed|failed|Error" "$W/ring.log" | tail -5
for w in 64 0; do
  step 30 "p_w$w" python3 bench/profile_engine.py --kv-format fp8 --kv-exact-window $w \
    --replays 20 --steps 5 --out "$W/p_w$w"
  grep -E "replay wall|_decode_kernel" "$W/p_w$w.log" | head -3
done
