#!/usr/bin/env bash
# Session 13, third device call: the whole GPU suite on the new defaults (sparse attention
# tilings incl. bf16 rows at decode batches, hc projection target, the top-k plan), then the
# hybrid decode steps (4K / 32K / 128K at batch 32, 128K at batch 256; fp8 and exact) with
# kernel tables, and end to end against Hugging Face (fp8 and bf16 rows).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 200 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -12
step 50 hybrid_b32 python3 bench/bench_hybrid.py --contexts 4096,32768,131072 --formats fp8,exact --profile 1 --out "$W/hybrid_b32.json"
grep -E "^ +(fp8|exact) |async|ALL KERNELS|topk|sparse_att|hc_proj" "$W/hybrid_b32.log" | head -40
step 45 hybrid_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --profile 1 --out "$W/hybrid_b256.json"
grep -E "131072|async|ALL KERNELS|hc_proj|index_scores|sparse_att|topk" "$W/hybrid_b256.log" | head -16
step 220 e2e python3 bench/bench_hybrid_hf.py --split --out "$W/e2e.json"
grep -E "tok/s" "$W/e2e.log"
