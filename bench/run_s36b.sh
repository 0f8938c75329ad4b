#!/usr/bin/env bash
# Session 36, call B: the dense paged decode with its programs ordered KV head first
# (KVPLAN_DECODE_HEADS_FIRST / heads_first=: a sequence's 8 heads side by side, reading the
# same token records, which the caches interleave), off against on. Session 19's ncu found
# bf16 at 32 x 8K moving 2x the KV bytes from DRAM (85.6 % busy, L2 hit rate 2.4 %), fp8 2.3x:
# each program reads 128 (64 + 8) bytes of a token's 1,024 (576), and its neighbours' parts
# leave L2 before their programs come.
# 1. GPU tests of the decode kernel's files with it on;
# 2. the kernel alone (CUDA-graph replays) at 32 x 8K, bf16 / fp8 / fp4, and ncu's DRAM bytes
#    and L2 hit rate, off / on;
# 3. the engine's long workload (32 x 8,192 x 256, fp8), off / on;
# 4. the kernel alone at 64 x 4K and 64 x 320; the short workload (64 x 256 x 128, bf16).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
KVPLAN_DECODE_HEADS_FIRST=1 gpu_tests hf_tests 80 8 tests/ops/test_paged_attention.py \
  tests/ops/test_paged_attention_quantized.py
qd() {  # BATCH CONTEXT: the default launch per format, both orders
  step 60 "qd_$1x$2" python3 bench/bench_quant_decode.py --graph --no-tiling --splits "" \
    --heads-first --formats bf16,fp8,fp4 --batch "$1" --context "$2" --out "$W/qd_$1x$2.json"
  grep -E "^ +(bf16|fp8|fp4) +(default|\{'heads)" "$W/qd_$1x$2.log"
}
qd 32 8192
if command -v ncu > /dev/null; then
  for v in 0 1; do
    step 45 "ncu_v$v" env KVPLAN_DECODE_HEADS_FIRST=$v ncu --clock-control none \
      -k regex:_decode_kernel --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
      python3 bench/ncu_decode.py --formats bf16,fp8
    grep -E "_decode_kernel|duration|dram__|lts__" "$W/ncu_v$v.log" | tail -12
  done
fi
for v in 0 1; do long_run "long_fp8_v$v" fp8 KVPLAN_DECODE_HEADS_FIRST=$v; done
qd 64 4096
qd 64 320
for v in 0 1; do
  step 40 "short_v$v" env KVPLAN_DECODE_HEADS_FIRST=$v python3 bench/bench_engine.py \
    --kv-format bf16 --hf "" --out "$W/short_v$v.json"
  grep -E "kvplan \(|decode step" "$W/short_v$v.log"
done
