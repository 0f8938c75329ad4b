#!/usr/bin/env bash
# Session 36, call B: the dense paged decode with its programs ordered KV head first
# (KVPLAN_DECODE_HEADS_FIRST / heads_first=: a sequence's 8 heads side by side, reading the
# same token records, which the caches interleave), off against on.
# 1. GPU tests of the decode kernel's files with it on;
# 2. the kernel alone (CUDA-graph replays): 32 x 8K, 64 x 4K, 64 x 320, bf16 / fp8 / fp4;
# 3. the engine: the long workload (32 x 8,192 x 256, fp8) and the short one (64 x 256 x 128,
#    bf16), off / on.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
KVPLAN_DECODE_HEADS_FIRST=1 gpu_tests hf_tests 90 8 tests/ops/test_paged_attention.py \
  tests/ops/test_paged_attention_quantized.py
for shape in "32 8192" "64 4096" "64 320"; do
  set -- $shape
  step 70 "qd_$1x$2" python3 bench/bench_quant_decode.py --graph --no-tiling --splits "" \
    --heads-first --formats bf16,fp8,fp4 --batch "$1" --context "$2" --out "$W/qd_$1x$2.json"
  grep -E "^ +(bf16|fp8|fp4) +(default|\{'heads)" "$W/qd_$1x$2.log"
done
for v in 0 1; do long_run "long_fp8_v$v" fp8 KVPLAN_DECODE_HEADS_FIRST=$v; done
for v in 0 1; do
  step 40 "short_v$v" env KVPLAN_DECODE_HEADS_FIRST=$v python3 bench/bench_engine.py \
    --kv-format bf16 --hf "" --out "$W/short_v$v.json"
  grep -E "kvplan \(|decode step" "$W/short_v$v.log"
done
