#!/usr/bin/env bash
# Session 53, call C: the decode step's latency-bound kernels on the H200 at the 32K x 32
# decode shapes (session 53's profile: top-k 2 x 13 us, index scores 23 us, split attention
# 20-27 us a layer): Nsight Compute's full report of each (the default launches), then the
# top-k's modes x digit widths (32 rows x 8,232 columns, 8,192 eligible) and the indexer's
# tiles x warps x stages (32 x 8,192 MXFP8 keys).
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
B=bench/bench_sparse_kernels.py
if command -v ncu > /dev/null; then
  step 90 ncu_attn ncu --clock-control none --set full -k regex:sparse_attention_split -c 1 \
    python3 $B --only attention --no-chunked --rows 32 --hca-entries 256
  step 60 ncu_index ncu --clock-control none --set full -k regex:index_scores_tc -c 1 \
    python3 $B --only index --rows 32 --candidates 8192 --index-kinds mxfp8
  step 60 ncu_topk ncu --clock-control none --set full -k regex:_topk_kernel -c 2 \
    python3 $B --only topk --rows 32 --candidates 8192 --topk-width 8232
  grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Block Limit" \
    "$W"/ncu_*.log | cut -c1-140
else
  echo "no ncu on this machine"
fi
step 100 topk python3 $B --only topk --rows 32 --candidates 8192 --topk-width 8232 \
  --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-130
step 250 index python3 $B --only index --rows 32 --candidates 8192 --index-kinds mxfp8 \
  --sweep --sweep-stages --out "$W/index.json"
grep -E "^index" "$W/index.log" | cut -c1-130
