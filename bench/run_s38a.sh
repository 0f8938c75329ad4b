#!/usr/bin/env bash
# Prepared in session 37 for the next session's first call: two KV heads a program for fp4
# (and int8) pages, which session 37 measured only as one call at 32 x 8K on the H100 (fp4
# 127.2 vs 140.5 us at DECODE_TILING_HEADS' (32, 2, 3); int8 155.9 vs 166.6 at (64, 2, 2)).
# fp8 takes two heads above 4,096 keys by default since session 37 (DECODE_HEADS_AUTO).
# 1. GPU tests of the decode kernel's files with KVPLAN_DECODE_HEADS=2 (the new fp4 / int8
#    tilings);
# 2. fp4 / int8 decode alone at 64 x 1K / 2K / 4K, one head (default) vs two (their tiling),
#    to place a bound as fp8's (4,096);
# 3. fp8 two heads under other register caps (below).
# The engine runs are bench/run_s38b.sh.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
KVPLAN_DECODE_HEADS=2 gpu_tests h2_tests 170 12 tests/ops/test_paged_attention.py \
  tests/ops/test_paged_attention_quantized.py
for ctx in 1024 2048 4096; do
  step 40 "qd_64x$ctx" python3 bench/bench_quant_decode.py --graph --splits "" --batch 64 \
    --context "$ctx" --no-tiling --heads 2 --formats fp4,int8 --out "$W/qd_64x$ctx.json"
  grep -E "^ +(fp4|int8) (default|\{)" "$W/qd_64x$ctx.log"
done
# fp8 two heads under other register caps (sm_90 compiles, session 37: (32, 2, 3) spills 68 B
# at the 168 cap, none at 200 (5 programs an SM); (16, 2, 3) none at 144 (7), 28 B at 128 (8))
for shape in "32 8192" "64 4096"; do
  set -- $shape
  step 70 "qd_caps_$1x$2" python3 bench/bench_quant_decode.py --graph --splits "" --batch "$1" \
    --context "$2" --tiles 16,32 --warps 2 --stages 3 --heads 2 --maxnreg 128,144,200 \
    --formats fp8 --out "$W/qd_caps_$1x$2.json"
  grep -E "^ +fp8 .*heads" "$W/qd_caps_$1x$2.log" | sort -t: -k2 -n | head -5
done
