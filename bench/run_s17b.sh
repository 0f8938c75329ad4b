#!/usr/bin/env bash
# Session 17, call B: the long workload (32 x 8,192 x 256) with fp8 and the fused store's
# stored values (no read-back of a prompt's rows) vs without (KVPLAN_STORED_VALUES=0), and bf16;
# fp4 with and without the searched scales (short workload); the hc projection's decode plans
# with the residual update fused (hc_post_pre); the dense decode attention at the short
# workload's shape as CUDA-graph replays.
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
grep -E "kvplan \(|decode step" "$W/long_fp8.log"
step 80 long_fp8_readback env KVPLAN_STORED_VALUES=0 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_readback.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_readback.log"
step 85 long_bf16 python3 bench/bench_engine.py --kv-format bf16 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_bf16.json"
grep -E "kvplan \(|decode step" "$W/long_bf16.log"
step 45 short_fp4 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4.json"
grep -E "kvplan \(|decode step" "$W/short_fp4.log"
step 45 short_fp4_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp4_plain.log"
step 140 hc_sweep python3 bench/bench_dsv4_blocks.py --rows 32 --hc-rows 32 --sweep --out "$W/hc_sweep.json"
grep -A14 "hc_pre plans" "$W/hc_sweep.log"
step 90 qdecode python3 bench/bench_quant_decode.py --batch 64 --context 320 --graph --formats bf16,fp8 --tiles 16,32,64 --warps 2,4 --stages 2,3 --splits 1,2,4 --out "$W/qdecode.json"
grep -E "default|fastest|best" "$W/qdecode.log" | head -12
