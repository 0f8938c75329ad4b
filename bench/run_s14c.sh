#!/usr/bin/env bash
# Session 14, call C: GPU tests of the greedy argmax kernel and of the engines reading logits
# in the model dtype; the argmax side by side with the fp32 copy + torch path; the fused hc
# residual update A/B inside the hybrid decode step (batch 32, 32K, fp8); the top-k plans at
# widths just past a power of two (the engine's decode widths: 8,196 / 32,772 columns); the
# dense and the hybrid end to end against HF.
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_argmax.py tests/engine tests/models/test_deepseek_v4_blocks.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 40 argmax python3 bench/bench_argmax.py --sweep --out "$W/argmax.json"
cat "$W/argmax.log" | grep -v Warn
step 100 hc_ab python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --hc-fused-max-rows 256,0,256,0 --out "$W/hc_ab.json"
grep -E "fp8 |async" "$W/hc_ab.log"
step 70 topk_odd python3 bench/bench_sparse_kernels.py --rows 32 --candidates 8196,32772 --only topk --out "$W/topk_odd.json"
grep -E "FASTEST|old  |row|compact" "$W/topk_odd.log" | head -40
step 120 dense_hf python3 bench/bench_engine.py --out "$W/dense_hf.json"
grep -E "tok/s|x HF|kvplan|HF |decode step" "$W/dense_hf.log" | tail -8
step 200 hybrid_hf python3 bench/bench_hybrid_hf.py --split --out "$W/hybrid_hf.json"
grep -E "tok/s|x HF|kvplan|HF " "$W/hybrid_hf.log" | tail -10
