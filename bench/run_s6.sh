#!/usr/bin/env bash
# The GPU call session 6 (2026-12-01) prepared and could not run (its device time was spent):
# hybrid decode with the new kernels, the GPU tests of the new kernels, the kvplan side of the
# HF comparison, the dense bf16 / fp8 A/B, under a wall-time budget (later steps skip when it
# is gone; BUDGET=seconds). The microbenchmarks of the new kernels: bench/run_all_gpu.sh OUT
# sparse_kernels compress_store dsv4_blocks moe_grouped.
set -u
source bench/gpu_steps.sh
step 70 hybrid python3 bench/bench_hybrid.py --modes graphs --profile 1 --out "$W/hybrid.json"
grep -E "^ +(fp8|exact) |Error" "$W/hybrid.log"
step 80 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  tests/ops/test_compress_store.py tests/ops/test_hyper_connection.py tests/ops/test_rms_norm.py \
  tests/ops/test_moe_dense.py tests/models/test_deepseek_v4_blocks.py \
  tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py \
  tests/ops/test_sparse_attention.py tests/engine/test_hybrid_graphs.py \
  tests/engine/test_hybrid_async.py tests/engine/test_deepseek_v4_engine.py tests/ops/test_load.py \
  tests/ops/test_sparse_split.py tests/ops/test_moe_grouped.py \
  tests/models/test_deepseek_v4_fused_projections.py tests/backends/test_backends_device_expand.py \
  tests/ops/test_store.py tests/cache/test_kv_tensors.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | tail -12
step 60 hybrid_hf python3 bench/bench_hybrid_hf.py --no-hf --out "$W/hybrid_hf.json"
grep -E "kvplan|Error" "$W/hybrid_hf.log" | tail -3
for f in bf16 fp8 int8; do
  step 40 "engine_$f" python3 bench/bench_engine.py --hf '' --kv-format $f --out "$W/engine_$f.json"
  grep -iE "tok/s" "$W/engine_$f.log" | tail -2
done
