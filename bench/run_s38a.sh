#!/usr/bin/env bash
# Prepared in session 37 for the next session's first call: two KV heads a program for fp4
# (and int8) pages, which session 37 measured only as one call at 32 x 8K on the H100 (fp4
# 127.2 vs 140.5 us at DECODE_TILING_HEADS' (32, 2, 3); int8 155.9 vs 166.6 at (64, 2, 2)).
# fp8 takes two heads above 4,096 keys by default since session 37 (DECODE_HEADS_AUTO).
# 1. GPU tests of the decode kernel's files with KVPLAN_DECODE_HEADS=2 (the new fp4 / int8
#    tilings);
# 2. fp4 / int8 decode alone at 64 x 1K / 2K / 4K, one head (default) vs two (their tiling),
#    to place a bound as fp8's (4,096);
# 3. the long workload (32 x 8,192 x 256) with fp4 and with int8 pages, one vs two heads;
#    fp8's default beside them.
# If two heads win the engine runs, add ("e2m1_f16": (2, bound)) / ("int8": (2, bound)) to
# DECODE_HEADS_AUTO.
set -u
BUDGET=${BUDGET:-570}
LONG_SECS=80
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
tests=(tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py)
step 170 h2_tests env KVPLAN_DECODE_HEADS=2 python3 -m pytest -q -m gpu -n 12 \
  -p no:cacheprovider --tb=short -rf "${tests[@]}"
grep -E "passed|failed|^FAILED|^E  " "$W/h2_tests.log" | head -20
for ctx in 1024 2048 4096; do
  step 40 "qd_64x$ctx" python3 bench/bench_quant_decode.py --graph --splits "" --batch 64 \
    --context "$ctx" --no-tiling --heads 2 --formats fp4,int8 --out "$W/qd_64x$ctx.json"
  grep -E "^ +(fp4|int8) (default|\{)" "$W/qd_64x$ctx.log"
done
for fmt in fp4 int8; do
  long_run "long_${fmt}_h1" "$fmt" KVPLAN_DECODE_HEADS=1
  long_run "long_${fmt}_h2" "$fmt" KVPLAN_DECODE_HEADS=2
done
long_run long_fp8 fp8
