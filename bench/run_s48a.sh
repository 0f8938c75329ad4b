#!/usr/bin/env bash
# Session 48, call A: the dense decode kernel's split partials merged by the last program of
# each (sequence, head group) (`_decode_kernel` FUSED, KVPLAN_DECODE_FUSED_MERGE, default on)
# instead of a `_combine_kernel` launch. GPU tests (the fused merge against the combine launch,
# bit for bit, eager and in graph replays); the kernel alone at 32 x 8K and 64 x 320 with the
# merge fused / not; the short workload's decode graph and the whole workloads with splits at
# short contexts (32 keys x 2 warps x 3 stages, 2 splits) against the default one-split launch;
# the long fp8 workload with the merge fused / not.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 100 8 tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py \
  tests/ops/test_paged_attention_ring.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_quantized_kv_engine.py
for f in 1 0; do
  step 60 "q8k_f$f" env KVPLAN_DECODE_FUSED_MERGE=$f python3 bench/bench_quant_decode.py --graph \
    --formats bf16,fp8 --no-tiling --splits 1,2,3,4 --out "$W/q8k_f$f.json"
  grep -E " us$" "$W/q8k_f$f.log" | head -20
done
step 50 q320 python3 bench/bench_quant_decode.py --graph --formats bf16,fp8 --batch 64 \
  --context 320 --tiles 32,64 --warps 2,4 --stages 3 --splits 1,2,3 --out "$W/q320.json"
grep -E " us$" "$W/q320.log" | head -30
SPLIT2=(KVPLAN_DECODE_SPLITS=2 KVPLAN_DECODE_TILING=32,2,3)
step 45 p_def python3 bench/profile_engine.py --out "$W/p_def" --replays 20
grep -E "kernel time|_decode_kernel|_combine|replay wall" "$W/p_def.log"
step 45 p_s2 env "${SPLIT2[@]}" python3 bench/profile_engine.py --out "$W/p_s2" --replays 20
grep -E "kernel time|_decode_kernel|_combine|replay wall" "$W/p_s2.log"
short_run s_def bf16
short_run s_s2 bf16 "${SPLIT2[@]}"
short_run s_def2 bf16
long_run l_f1 fp8
long_run l_f0 fp8 KVPLAN_DECODE_FUSED_MERGE=0
