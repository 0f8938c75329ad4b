#!/usr/bin/env bash
# Session 33, call C: are the fp8 kernels bound by their dequantizing arithmetic?
# 1. The indexer's mxfp8 scoring alone, 256 x 32,768 and 32 x 8,192: bf16 tiles (default),
#    fp16 tiles per scale group (f16=1, call B: slower), the whole tile scaled in fp16 (f16=2,
#    an experiment), key tiles per program x software pipelining (256 rows only).
# 2. Decode attention over V41 fp8 records in fp16 tiles (KVPLAN_SPARSE_FP8_F16=1, an
#    experiment) against bf16 tiles: the kernels alone at 256 rows.
# 3. The top-k alone at 256 x 32,768.
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
step 100 s256 python3 bench/bench_sparse_kernels.py --only index --rows 256 --candidates 32768 \
  --index-kinds mxfp8 --sweep-stages --out "$W/s256.json"
grep -E "index_scores" "$W/s256.log" | cut -c1-150
for f in 0 1; do
  step 50 att$f env KVPLAN_SPARSE_FP8_F16=$f python3 bench/bench_sparse_kernels.py \
    --only attention --rows 256 --hca-entries 1024 --out "$W/att$f.json"
  grep -E "^(csa|hca|sparse)|FASTEST" "$W/att$f.log" | cut -c1-150
done
step 40 topk python3 bench/bench_sparse_kernels.py --only topk --rows 256 --candidates 32768 \
  --out "$W/topk.json"
grep -E "topk" "$W/topk.log" | cut -c1-150 | head -30
