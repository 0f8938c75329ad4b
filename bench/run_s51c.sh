#!/usr/bin/env bash
# Session 51, call C (calls A and B cut to one start's device time): the sparse decode
# attention's split count rounded down to one wave (KVPLAN_SPARSE_ONE_WAVE) against the
# default, alone at 32 rows and in the 32K x 32 fp8 decode step, alternating; the dense
# default split-K projections against none end to end; then the whole GPU suite with what is
# left.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
step 70 kern python3 bench/bench_sparse_kernels.py --only attention --no-chunked --rows 32 \
  --hca-entries 256,1024 --splits 3,4,5,6 --out "$W/kern.json"
grep -E "^sparse_attention" "$W/kern.log" | cut -c1-110
for r in a b; do
  for v in 0 1; do hybrid_decode w$v$r 32 32768 KVPLAN_SPARSE_ONE_WAVE=$v; done
done
short_run off bf16 KVPLAN_SPLIT_LINEAR=0
short_run on bf16
gpu_tests suite $(( $(left) - 5 )) 14 tests
grep -E "passed|failed|error" "$W/suite.log" | tail -3
