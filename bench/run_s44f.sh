#!/usr/bin/env bash
# Session 44, call F: the ring engine test with a small max_num_seqs (call E's default 64 capture
# dummies did not fit its 64 blocks, and the failed capture leaked them: fixed), the graph tests.
set -u
BUDGET=${BUDGET:-200}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 170 8 tests/engine/test_kv_exact_window.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_quantized_kv_engine.py
