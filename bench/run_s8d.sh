#!/usr/bin/env bash
# Session 8, fourth GPU call: the fixed GPU tests, the paged decode split-K sweep, the
# pipelined hybrid decode step at 32K / 128K with fp8 and bf16 KV.
set -u
source bench/gpu_steps.sh
step 75 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_topk.py tests/ops/test_hyper_connection_fused.py tests/ops/test_hyper_connection.py tests/backends/test_hybrid_gpu_kernels.py tests/models/test_deepseek_v4_blocks.py "tests/ops/test_compress_store.py::test_in_kernel_gate_bias_is_bit_identical_on_gpu"
grep -E "passed|failed|^FAILED|^E  " "$W/gpu_tests.log" | head -16
step 40 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --splits 1,2,4,8,16,32 --no-tiling --out "$W/quant_decode.json"
grep -E "^  " "$W/quant_decode.log" | head -24
step 130 hybrid python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --time-budget 100 --out "$W/hybrid.json"
grep -vE "^ {4}" "$W/hybrid.log" | grep -E "graphs|async|format" | head -10
