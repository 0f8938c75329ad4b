#!/usr/bin/env bash
# Session 36, call B: the dense paged decode's DRAM traffic. Session 19's ncu found bf16 at
# 32 x 8K moving 2x the KV bytes from DRAM (85.6 % busy, L2 hit rate 2.4 %), fp8 2.3x: each
# program reads one head's 128 (fp8: 64 + 8) bytes of a token's 1,024 (576), and the
# neighbouring heads' programs come too late to find their parts in L2. Two remedies, each
# against the default:
# - KVPLAN_DECODE_HEADS_FIRST / heads_first=: programs ordered KV head first, so a
#   sequence's 8 heads run side by side;
# - heads= / KVPLAN_DECODE_HEADS: 2 or 4 neighbouring KV heads a program, read as one head
#   (one contiguous run a key; a block-diagonal query tile), swept over tilings.
# 1. GPU tests of the decode kernel's files with both on (heads 2, KV head first);
# 2. the kernel alone (CUDA-graph replays) at 32 x 8K: each format's default both orders; the
#    heads sweep (bf16, fp8); ncu's DRAM bytes and L2 hit rate in both orders;
# 3. the engine's long workload (32 x 8,192 x 256, fp8) in both orders;
# 4. the kernel alone at 64 x 320; the short workload (64 x 256 x 128, bf16) in both orders.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
KVPLAN_DECODE_HEADS_FIRST=1 KVPLAN_DECODE_HEADS=2 gpu_tests hd_tests 80 8 \
  tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py
qd() {  # NAME BATCH CONTEXT ARGS...: bench_quant_decode, CUDA-graph replays, no split sweep
  local name=$1 b=$2 c=$3; shift 3
  step 100 "$name" python3 bench/bench_quant_decode.py --graph --splits "" --batch "$b" \
    --context "$c" --out "$W/$name.json" "$@"
  grep -E "^ +(bf16|fp8|fp4) +(default|\{)" "$W/$name.log"
}
qd qd_order 32 8192 --no-tiling --heads 2,4 --heads-first --formats bf16,fp8,fp4
qd qd_heads 32 8192 --tiles 32,64 --warps 2,4 --stages 3 --heads 2,4 --formats bf16,fp8
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
qd qd_short 64 320 --no-tiling --heads-first --heads 2,4 --formats bf16,fp8
for v in 0 1; do
  step 40 "short_v$v" env KVPLAN_DECODE_HEADS_FIRST=$v python3 bench/bench_engine.py \
    --kv-format bf16 --hf "" --out "$W/short_v$v.json"
  grep -E "kvplan \(|decode step" "$W/short_v$v.log"
done
