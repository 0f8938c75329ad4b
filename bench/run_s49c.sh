#!/usr/bin/env bash
# Session 49, call C (the device time left): first the GPU tests of what changed since the
# whole GPU suite last ran (session 45): the fresh-prefill paths (session 48 refactored their
# rebased cu_seqlens) and the windowed prompts' `rows` mode (session 47); then the whole GPU
# suite with what remains of the budget.
set -u
BUDGET=${BUDGET:-230}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests changed 80 14 tests/backends/test_fresh_prefill_gpu.py tests/engine/test_kv_exact_window.py \
  tests/ops/test_paged_attention_ring.py
gpu_tests suite $(( $(left) - 5 )) 14 tests
grep -E "passed|failed|error" "$W/suite.log" | tail -5
