#!/usr/bin/env bash
# Session 36, call C: two KV heads a program for fp8 pages at (32 keys, 2 warps, 3 stages),
# the fastest launch of call B at 32 x 8K (145.6 us against the default's 168.2 on the H100):
# 1. GPU tests of the decode kernel's files with KVPLAN_DECODE_HEADS=2 (call B's run of them,
#    with the KV-head-first order also on, had 3 failures before its time ran out);
# 2. the kernel alone at 32 x 8K, 64 x 1K and 64 x 320 (fp8): default / (32, 2, 3), heads 1 / 2;
# 3. the engine's long workload (32 x 8,192 x 256, fp8): default against heads 2 at (32, 2, 3).
set -u
BUDGET=${BUDGET:-265}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 100 hd2_tests env KVPLAN_DECODE_HEADS=2 python3 -m pytest -q -m gpu -n 8 \
  -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention.py \
  tests/ops/test_paged_attention_quantized.py
grep -E "passed|failed|^FAILED|^E  " "$W/hd2_tests.log" | head -30
qd() {  # BATCH CONTEXT: fp8, default / (32, 2, 3), heads 1 / 2
  step 40 "qd_$1x$2" python3 bench/bench_quant_decode.py --graph --splits "" --batch "$1" \
    --context "$2" --tiles 32 --warps 2 --stages 3 --heads 2 --formats fp8 \
    --out "$W/qd_$1x$2.json"
  grep -E "^ +fp8 (default|\{)" "$W/qd_$1x$2.log"
}
qd 32 8192
long_run long_fp8_h1 fp8
long_run long_fp8_h2 fp8 KVPLAN_DECODE_HEADS=2 KVPLAN_DECODE_TILING=32,2,3
qd 64 1024
qd 64 320
