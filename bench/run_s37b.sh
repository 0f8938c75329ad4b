#!/usr/bin/env bash
# Session 37, call B: why two KV heads a program (KVPLAN_DECODE_HEADS=2) was 13 % faster as
# one fp8 decode call at 32 x 8K (call A: 146.4 vs 166.7 us) but its engine graph replay of the
# long workload slower (3.604 vs 3.408 ms); and its GPU tests with a step long enough to end
# (call A's 100-s steps stopped both runs after 22 of 23 tests, none failed).
# 1. the decode graph's kernels, long workload shape (32 x 8,192, fp8), default vs heads=2;
# 2. one call at 32 x 8K, heads=2 at (32, 2, 3): register cap none / 168 x splits 3 / 6;
# 3. GPU tests of the decode kernel's files with KVPLAN_DECODE_HEADS=2, then HEADS_FIRST=1.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for v in h1 h2; do
  extra=(); [ $v = h2 ] && extra=(KVPLAN_DECODE_HEADS=2)
  step 75 "prof_$v" env "${extra[@]}" python3 bench/profile_engine.py --kv-format fp8 \
    --num-requests 32 --prompt-len 8192 --replays 10 --steps 10 --out "$W/prof_$v"
  grep -E "kernel time per step|replay wall|_decode_kernel|_combine" "$W/prof_$v.log" | head -6
done
step 70 qd_plan python3 bench/bench_quant_decode.py --graph --splits "" --batch 32 \
  --context 8192 --tiles 32 --warps 2 --stages 3 --heads 2 --maxnreg 168 --with-splits 3,6 \
  --formats fp8 --out "$W/qd_plan.json"
grep -E "^ +fp8 " "$W/qd_plan.log" | head -40
tests=(tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py)
step 200 h2_tests env KVPLAN_DECODE_HEADS=2 python3 -m pytest -q -m gpu -n 12 \
  -p no:cacheprovider --tb=short -rf --durations=5 "${tests[@]}"
grep -E "passed|failed|^FAILED|^E  |s call" "$W/h2_tests.log" | head -20
step 150 hf_tests env KVPLAN_DECODE_HEADS_FIRST=1 python3 -m pytest -q -m gpu -n 12 \
  -p no:cacheprovider --tb=short -rf --durations=5 "${tests[@]}"
grep -E "passed|failed|^FAILED|^E  |s call" "$W/hf_tests.log" | head -20
