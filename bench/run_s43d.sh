#!/usr/bin/env bash
# Session 43, call D: the whole GPU suite at the session's final code (speculative decoding on
# DeepSeek-V4, the folded indexer weights, the top-k without its count fill, the shared test
# helpers).
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 290 14 tests
