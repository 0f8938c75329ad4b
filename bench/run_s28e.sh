#!/usr/bin/env bash
# Session 28, call E (the last): the whole GPU suite at the session's code, the workload
# against HF side by side, the HCA decode split A/B at the workload's shape, the decode step
# at 32K x 32, and few-row GEMM tiles at the DeepSeek-V4 decode shapes (M = 16).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 290 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_suite.log" | tail -12
step 170 e2e python3 bench/bench_hybrid_hf.py --kv-formats fp8 --out "$W/e2e.json"
grep -E "^ +(hf|kvplan) " "$W/e2e.log" | cut -c1-300
for f in 2 1; do
  step 30 split$f env KVPLAN_SPARSE_MIN_SPLIT_TILES=$f python3 bench/bench_hybrid.py --batch 16 \
    --contexts 4096 --formats fp8 --out "$W/split$f.json"
  grep -E "^ *fp8 |async" "$W/split$f.log"
done
step 30 dec32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --out "$W/dec32k.json"
grep -E "^ *fp8 |async" "$W/dec32k.log"
step 40 gemm python3 bench/bench_small_gemm.py --reps 10 --shapes 16,2048,4096,o_b \
  16,2048,2048,x_hca 16,3616,2048,x_csa 16,12288,512,q_res_csa 16,8192,512,q_res_hca \
  --out "$W/gemm.json"
grep -vE "^\s*$" "$W/gemm.log" | tail -14
