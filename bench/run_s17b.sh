#!/usr/bin/env bash
# Session 17, call B: the dense decode attention at the short workload's decode shape (64
# sequences x 320 keys, llama-1b heads) timed as CUDA-graph replays over tilings and split
# counts (eager calls there time the host), and fp4 with and without the searched scales.
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 120 qdecode python3 bench/bench_quant_decode.py --batch 64 --context 320 --graph --formats bf16,fp8 --tiles 16,32,64 --warps 2,4 --stages 2,3 --splits 1,2,4 --out "$W/qdecode.json"
grep -E "default|fastest|best" "$W/qdecode.log" | head -12
step 45 short_fp4 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4.json"
grep -E "kvplan \(|decode step" "$W/short_fp4.log"
step 45 short_fp4_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp4_plain.log"
step 160 hc_sweep python3 bench/bench_dsv4_blocks.py --rows 32 --hc-rows 32 --sweep --out "$W/hc_sweep.json"
grep -A14 "hc_pre plans" "$W/hc_sweep.log"
