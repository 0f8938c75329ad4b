#!/usr/bin/env bash
# Session 11, last device call: the tracebacks of the prefetch bit-identity tests that failed
# in run_s10's GPU tests (the log was cut by its timeout), the whole GPU suite, and the sparse
# prefill kernel with its key tiles loaded a step ahead.
set -u
source bench/gpu_steps.sh
step 60 prefetch_tests python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "tests/ops/test_paged_attention_quantized.py::test_gpu_prefetched_tiles_are_bit_identical" "tests/ops/test_sparse_split.py::test_cuda_prefetched_key_tiles_are_bit_identical"
grep -E "^E " "$W/prefetch_tests.log" | head -12
step 380 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=line -rf tests
grep -E "passed|failed|^FAILED|^/" "$W/gpu_suite.log" | tail -30
step 60 sparse_prefill python3 bench/bench_sparse_kernels.py --only prefill --prefill-short --out "$W/sparse_prefill.json"
grep -E "FASTEST|prefetch" "$W/sparse_prefill.log" | tail -6
