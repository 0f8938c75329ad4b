#!/usr/bin/env bash
# Session 44, call B: kv_exact_window (each sequence's newest K/V rows read unquantized from a
# ring beside the fp8 / int8 / fp4 pages): the ring's kernel tests, the engine's GPU test,
# and the paged-attention / quantized-engine GPU tests the kernel change touches.
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 240 8 tests/ops/test_paged_attention_ring.py tests/engine/test_kv_exact_window.py \
  tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py \
  tests/engine/test_quantized_kv_engine.py
