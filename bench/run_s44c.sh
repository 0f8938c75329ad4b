#!/usr/bin/env bash
# Session 44, calls C and D: kv_exact_window's engine GPU test, fixed to give the CPU engine the CUDA
# engine's weights (random weights differ by device; call B's version compared two models).
set -u
BUDGET=${BUDGET:-200}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests ring 150 4 tests/engine/test_kv_exact_window.py tests/ops/test_paged_attention_ring.py
