#!/usr/bin/env bash
# Session 17, call D: end to end against Hugging Face with the hybrid decode step of call C
# (16 x 4,096 prompt x 128 new tokens, fp8 and bf16 rows).
set -u
BUDGET=${BUDGET:-250}
source bench/gpu_steps.sh
step 240 hybrid_hf python3 bench/bench_hybrid_hf.py --split --out "$W/hybrid_hf.json"
grep -E "tok/s|x HF|kvplan|HF " "$W/hybrid_hf.log" | tail -8
