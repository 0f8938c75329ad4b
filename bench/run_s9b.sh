#!/usr/bin/env bash
# Prepared at the end of session 8 for the next session's second GPU call (dense engine):
# prefill attention with the SDPA path, decode attention per format without the checks' sync,
# the long workload bf16 vs fp8 end to end, the Gemma-3 window-pool batch to its peak.
set -u
source bench/gpu_steps.sh
step 60 prefill python3 bench/bench_paged_attention.py --prefill-only --no-sweep --out "$W/prefill.json"
tail -12 "$W/prefill.log"
step 60 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,int8,fp4 --splits 2,4,8,16 --no-tiling --out "$W/quant_decode.json"
grep -E "^  " "$W/quant_decode.log" | head -24
step 150 long_bf16 python3 bench/bench_engine.py --kv-format bf16 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_bf16.json"
tail -4 "$W/long_bf16.log"
step 150 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
tail -4 "$W/long_fp8.log"
step 170 gemma3 python3 bench/bench_gemma3.py --hf "" --time-budget 160 --out "$W/gemma3.json"
tail -6 "$W/gemma3.log"
