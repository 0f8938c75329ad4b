#!/usr/bin/env bash
# Session 48, call B: the fused merge loading MERGE_CHUNK splits' partials at once (call A's
# merge walked the splits one load at a time, twice: fp8's default launch at 32 x 8K, 6 splits,
# was 11 us slower fused). GPU tests of the merge; the fp8 kernel alone at 32 x 8K (default
# launch) fused with chunks of 2 / 4 and not fused; the long fp8 workload fused / not.
set -u
BUDGET=${BUDGET:-330}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 70 4 tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py \
  tests/ops/test_paged_attention_ring.py -k "fused or gpu or graph"
for v in "1 2" "1 4" "0 2"; do
  set -- $v
  step 40 "q8k_f$1c$2" env KVPLAN_DECODE_FUSED_MERGE=$1 KVPLAN_DECODE_MERGE_CHUNK=$2 \
    python3 bench/bench_quant_decode.py --graph --formats bf16,fp8 --no-tiling --splits 2,4 \
    --out "$W/q8k_f$1c$2.json"
  grep -E " us$" "$W/q8k_f$1c$2.log"
done
long_run l_f1 fp8
long_run l_f0 fp8 KVPLAN_DECODE_FUSED_MERGE=0
