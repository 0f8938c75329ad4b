#!/usr/bin/env bash
# Prepared in session 36 for the next session's first call (supersedes run_s36c / run_s36d,
# which never ran): the dense decode options of session 36, off by default until this runs.
# 1. GPU tests of the decode kernel's files with each option alone (call B of session 36
#    ran them with both on at once and hit 3 failures it could not name): KV head first;
#    two heads a program (DECODE_TILING_HEADS: fp8 (32, 2, 3), bf16 (64, 4, 3));
# 2. fp8, two heads a program: the kernel at 32 x 8K / 64 x 4K / 64 x 1K / 64 x 320 over
#    tilings around (32, 2, 3);
# 3. the long workload (32 x 8,192 x 256, fp8) and the short one (64 x 256 x 128, fp8): default
#    against two heads a program (KVPLAN_DECODE_HEADS=2: fp8 at (32, 2, 3)).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
tests=(tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py)
step 100 hf_tests env KVPLAN_DECODE_HEADS_FIRST=1 python3 -m pytest -q -m gpu -n 8 \
  -p no:cacheprovider --tb=short -rf "${tests[@]}"
grep -E "passed|failed|^FAILED|^E  " "$W/hf_tests.log" | head -20
step 100 h2_tests env KVPLAN_DECODE_HEADS=2 python3 -m pytest -q \
  -m gpu -n 8 -p no:cacheprovider --tb=short -rf "${tests[@]}"
grep -E "passed|failed|^FAILED|^E  " "$W/h2_tests.log" | head -20
for shape in "32 8192" "64 4096" "64 1024" "64 320"; do
  set -- $shape
  step 45 "qd_$1x$2" python3 bench/bench_quant_decode.py --graph --splits "" --batch "$1" \
    --context "$2" --tiles 16,32 --warps 2 --stages 3,4 --heads 2 --formats fp8 \
    --out "$W/qd_$1x$2.json"
  grep -E "^ +fp8 (default|\{)" "$W/qd_$1x$2.log"
done
long_run long_fp8_h1 fp8
long_run long_fp8_h2 fp8 KVPLAN_DECODE_HEADS=2
short_run short_h1 fp8
short_run short_h2 fp8 KVPLAN_DECODE_HEADS=2
