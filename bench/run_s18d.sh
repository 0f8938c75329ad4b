#!/usr/bin/env bash
# Session 18, call D: the dense decode step's attention at the engine's shape (64 x 320
# context, CUDA-graph replays: tiling and split sweep, bf16 and fp8 pages), and the LM head
# inside the decode graph with cuBLAS (KVPLAN_SMALL_GEMM=0) against call C's small_linear.
set -u
BUDGET=${BUDGET:-400}
source bench/gpu_steps.sh
step 40 prof_bf16_cublas env KVPLAN_SMALL_GEMM=0 python3 bench/profile_engine.py --out "$W" --steps 10
head -20 "$W/prof_bf16_cublas.log" | grep -E "us/step|nvjet|small_linear|_decode|rms|epilogue|silu|device:"
step 200 dec_sweep python3 bench/bench_quant_decode.py --batch 64 --context 320 --formats bf16,fp8 --graph --splits 1,2,4,8 --tiles 16,32,64 --warps 2,4,8 --stages 2,3,5 --out "$W/dec_sweep.json"
grep -vE "^\s*$" "$W/dec_sweep.log" | tail -40
