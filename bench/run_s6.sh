#!/usr/bin/env bash
# The GPU call session 6 (2026-12-01) prepared and could not run (its device time was spent):
# hybrid decode with the new kernels, the GPU tests of the new kernels, the kvplan side of the
# HF comparison, the dense bf16 / fp8 A/B, under a wall-time budget (later steps skip when it
# is gone; BUDGET=seconds). The microbenchmarks of the new kernels: bench/run_all_gpu.sh OUT
# sparse_kernels compress_store dsv4_blocks moe_grouped.
set -u
O=${OUT:-/tmp/out}
BUDGET=${BUDGET:-200}
mkdir -p "$O"
export PYTHONPATH=.
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
step() {  # step SECONDS NAME CMD...: run CMD with timeout min(SECONDS, left) if >= 20 s remain
  local want=$1 name=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then echo "$name: skipped (budget)"; return; fi
  [ "$want" -gt "$l" ] && want=$l
  timeout "$want" "$@" > "$O/$name.log" 2>&1
  echo "$name rc=$? ($(( $(date +%s) - start )) s)"
}
step 70 hybrid python3 bench/bench_hybrid.py --modes graphs --profile 1 --out "$O/hybrid.json"
grep -E "^ +(fp8|exact) |Error" "$O/hybrid.log"
step 80 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  tests/ops/test_compress_store.py tests/ops/test_hyper_connection.py tests/ops/test_rms_norm.py \
  tests/ops/test_moe_dense.py tests/models/test_deepseek_v4_blocks.py \
  tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py \
  tests/ops/test_sparse_attention.py tests/engine/test_hybrid_graphs.py \
  tests/engine/test_hybrid_async.py tests/engine/test_deepseek_v4_engine.py tests/ops/test_load.py \
  tests/ops/test_sparse_split.py tests/ops/test_moe_grouped.py \
  tests/models/test_deepseek_v4_fused_projections.py tests/backends/test_backends_device_expand.py \
  tests/ops/test_store.py tests/cache/test_kv_tensors.py
grep -E "passed|failed|^FAILED" "$O/gpu_tests.log" | tail -12
step 60 hybrid_hf python3 bench/bench_hybrid_hf.py --no-hf --out "$O/hybrid_hf.json"
grep -E "kvplan|Error" "$O/hybrid_hf.log" | tail -3
for f in bf16 fp8 int8; do
  step 40 "engine_$f" python3 bench/bench_engine.py --hf '' --kv-format $f --out "$O/engine_$f.json"
  grep -iE "tok/s" "$O/engine_$f.log" | tail -2
done
