#!/usr/bin/env bash
# Session 33, call C: is the indexer's mxfp8 scoring bound by its arithmetic or by latency?
# The kernel alone at 256 x 32,768 and 32 x 8,192: bf16 tiles (default), fp16 tiles per scale
# group (f16=1, call B: slower), the whole tile scaled in fp16 (f16=2, an experiment), and key
# tiles per program x software pipelining; then the top-k at 256 x 32,768.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
for r in 256:32768 32:8192; do
  step 120 s${r%%:*} python3 bench/bench_sparse_kernels.py --only index --rows ${r%%:*} \
    --candidates ${r##*:} --index-kinds mxfp8 --sweep-stages --out "$W/s${r%%:*}.json"
  grep -E "index_scores" "$W/s${r%%:*}.log" | cut -c1-150
done
step 60 topk python3 bench/bench_sparse_kernels.py --only topk --rows 256 --candidates 32768 \
  --out "$W/topk.json"
grep -E "topk" "$W/topk.log" | head -30
