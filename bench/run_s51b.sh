#!/usr/bin/env bash
# Session 51, call B: the sparse decode attention's split count. split_count rounds the
# splits up (32 rows on 132 SMs: 5 splits, 160 programs of one a SM: two waves);
# KVPLAN_SPARSE_ONE_WAVE=1 rounds down (4 splits, 128 programs). The kernels alone at 32 rows
# over split counts, then the 32K x 32 fp8 decode step (and 16 / 64 rows) alternating.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
step 90 kern python3 bench/bench_sparse_kernels.py --only attention --no-chunked --rows 32 \
  --hca-entries 256,1024 --splits 2,3,4,5,6,8 --out "$W/kern.json"
grep -E "^sparse_attention" "$W/kern.log" | cut -c1-110
for r in a b; do
  for v in 0 1; do hybrid_decode w$v$r 32 32768 KVPLAN_SPARSE_ONE_WAVE=$v; done
done
hybrid_decode b16w0 16 32768 KVPLAN_SPARSE_ONE_WAVE=0
hybrid_decode b16w1 16 32768 KVPLAN_SPARSE_ONE_WAVE=1
hybrid_decode b64w0 64 32768 KVPLAN_SPARSE_ONE_WAVE=0
hybrid_decode b64w1 64 32768 KVPLAN_SPARSE_ONE_WAVE=1
# the hybrid bench model's fused expert gate/up + router GEMM at 32 rows (91 tiles of 384
# columns on 132 SMs): linear against split-K partials (the pair column: their total in torch)
step 40 gu python3 bench/bench_split_linear.py --shapes 32,34832,2048,gemm 16,34832,2048,gemm \
  --splits 1,2,4 --out "$W/gu.json"
grep -E " gemm " "$W/gu.log"
profile_32k prof1 "sparse_attention|ALL" KVPLAN_SPARSE_ONE_WAVE=1
