#!/usr/bin/env bash
# Session 53, call C (never started: no device time left after call B; the next session's
# first call): the decode step's latency-bound kernels on the H200 at the 32K x 32
# decode shapes (session 53's profile: top-k 2 x 13 us, index scores 23 us, split attention
# 20-27 us a layer). First the top-k's new one-stage row with a tail (KVPLAN_TOPK_ROW_TAIL)
# writing from its registers (KVPLAN_TOPK_REG_WRITE):
# alone among the modes x digit widths (32 rows x 8,232 columns, 8,192 eligible), then in
# the decode step against the parts of 4,096 (alternating); hc_pre's scalar Sinkhorn with 4
# decode warps against the default in the step; the dense decode's o / down / qkv
# GEMMs at 64 rows by split count; then Nsight Compute's full report
# of the three kernels; then the indexer's tiles x warps x stages (32 x 8,192 MXFP8 keys).
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
B=bench/bench_sparse_kernels.py
# the first run compiles the model's kernels on this fresh machine: a longer step
HD_SECS=75 hybrid_decode t0a 32 32768 KVPLAN_TOPK_ROW_TAIL=0 KVPLAN_TOPK_REG_WRITE=0
hybrid_decode t1a 32 32768 KVPLAN_TOPK_ROW_TAIL=1 KVPLAN_TOPK_REG_WRITE=1
step 60 topk python3 $B --only topk --rows 32 --candidates 8192 --topk-width 8232 \
  --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-130
for v in 0 1; do hybrid_decode t${v}b 32 32768 KVPLAN_TOPK_ROW_TAIL=$v KVPLAN_TOPK_REG_WRITE=$v; done
# hc_pre's Sinkhorn on per-thread scalars with 4 decode warps (KVPLAN_HC_SCALAR_SINKHORN,
# KVPLAN_HC_PRE_WARPS) against the default, in the step (alternating)
for r in a b; do
  hybrid_decode h0$r 32 32768
  hybrid_decode h1$r 32 32768 KVPLAN_HC_SCALAR_SINKHORN=1 KVPLAN_HC_PRE_WARPS=4
done
gpu_tests tests 100 14 tests/ops/test_topk.py tests/engine/test_deepseek_v4_engine.py \
  tests/engine/test_hybrid_graphs.py tests/ops/test_sparse_attention.py \
  tests/ops/test_hyper_connection_norm.py
# the hybrid engine's GPU tests with the four switches on (greedy fp32 tokens equal HF's)
step 100 tests_on env KVPLAN_TOPK_ROW_TAIL=1 KVPLAN_TOPK_REG_WRITE=1 KVPLAN_HC_SCALAR_SINKHORN=1 \
  KVPLAN_HC_PRE_WARPS=4 python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_graphs.py
tail -3 "$W/tests_on.log"
step 60 split python3 bench/bench_split_linear.py --shapes 64,2048,2048,o 64,2048,8192,down \
  64,3072,2048,qkv --splits 1,2,4,8 --out "$W/split.json"
grep -E " 64x" "$W/split.log" | cut -c1-120
step 90 index python3 $B --only index --rows 32 --candidates 8192 --index-kinds mxfp8 \
  --sweep --out "$W/index.json"
grep -E "^index" "$W/index.log" | cut -c1-130
if command -v ncu > /dev/null; then
  step 80 ncu_attn ncu --clock-control none --set full -k regex:sparse_attention_split -c 1 \
    python3 $B --only attention --no-chunked --rows 32 --hca-entries 256
  step 50 ncu_index ncu --clock-control none --set full -k regex:index_scores_tc -c 1 \
    python3 $B --only index --rows 32 --candidates 8192 --index-kinds mxfp8
  grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Block Limit" \
    "$W"/ncu_*.log | cut -c1-140
else
  echo "no ncu on this machine"
fi
