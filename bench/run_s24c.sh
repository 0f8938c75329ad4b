#!/usr/bin/env bash
# Session 24, call C: fp4 K/V stored inside the fused qkv epilogue (commit f59bb98).
# 1. GPU tests: the fused epilogue's store bytes (fp4 added) and the quantized-KV engines.
# 2. Long workload (32 x 8,192 x 256): fp4, fp4 with the (64, 2, 3) decode tiling that timed
#    137.6 against 139.3 us in call B, fp8.
# 3. Short workload (64 x 256 x 128): fp4, fp8.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf tests/models/test_fused_gpu.py tests/engine/test_quantized_kv_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
long_run long_fp4 fp4
long_run long_fp4_t3 fp4 KVPLAN_DECODE_TILING=64,2,3
long_run long_fp8 fp8
for f in fp4 fp8; do
  step 40 "short_$f" python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_$f.json"
  grep -E "kvplan \(|decode step" "$W/short_$f.log"
done
