#!/usr/bin/env bash
# Session 15, call A: where the hybrid prefill spends its time now (the 32K-token steps of the
# end-to-end workload, kernel table), and the dense decode attention's tiling / split sweep at
# the short workload's decode shape (64 sequences x 320 keys), bf16 and fp8.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
step 200 prefill python3 bench/bench_hybrid_hf.py --no-hf --kv-formats fp8 --split --profile-prefill --out "$W/prefill.json"
grep -E "tok/s|prefill" "$W/prefill.log" | head -20
step 150 attn_short python3 bench/bench_quant_decode.py --batch 64 --context 320 --formats bf16,fp8 --tiles 32,64,128 --warps 2,4 --stages 2,3,5 --splits 1,2,4 --out "$W/attn_short.json"
tail -8 "$W/attn_short.log"
