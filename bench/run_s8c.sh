#!/usr/bin/env bash
# Session 8, third GPU call: GPU tests of the new top-k and fused hyper-connection kernels
# (and the gate-bias test that failed), their benches, the pipelined hybrid decode step at
# 32K with its profile, the hybrid end to end vs HF (warm), the quantized decode sweep.
set -u
source bench/gpu_steps.sh
step 110 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_topk.py tests/ops/test_hyper_connection_fused.py tests/backends/test_hybrid_gpu_kernels.py tests/models/test_deepseek_v4_blocks.py "tests/ops/test_compress_store.py::test_in_kernel_gate_bias_is_bit_identical_on_gpu"
grep -E "passed|failed|^FAILED|^E  " "$W/gpu_tests.log" | head -30
step 40 topk python3 bench/bench_topk.py --sweep --out "$W/topk.json"
tail -14 "$W/topk.log"
step 50 hc python3 bench/bench_dsv4_blocks.py --out "$W/blocks.json"
grep -iE "hc_|rows" "$W/hc.log" | head -14
step 90 hybrid32k python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --profile 1 --time-budget 60 --out "$W/hybrid32k.json"
grep -vE "^ {4}" "$W/hybrid32k.log" | tail -9; grep -E "^ {4}" "$W/hybrid32k.log" | head -14
step 190 hybrid_hf python3 bench/bench_hybrid_hf.py --out "$W/hybrid_hf.json"
tail -3 "$W/hybrid_hf.log"
step 90 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --stages 2,3 --out "$W/quant_decode.json"
grep -vE "^  " "$W/quant_decode.log" | tail -10
