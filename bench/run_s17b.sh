#!/usr/bin/env bash
# Session 17, call B: the long workload (32 x 8,192 x 256) with fp8 and the fused store's
# stored values (no read-back of a prompt's rows) vs without (KVPLAN_STORED_VALUES=0);
# fp4 with and without the searched scales (short workload); the hc projection's decode plans
# with the residual update fused (hc_post_pre); the fused store's scale search unrolled vs in
# a loop (KVPLAN_SEARCH_UNROLL=0; call A: searched 1.440 ms a decode step, plain 1.401).
set -u
BUDGET=${BUDGET:-580}
source bench/gpu_steps.sh
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
grep -E "kvplan \(|decode step" "$W/long_fp8.log"
step 80 long_fp8_readback env KVPLAN_STORED_VALUES=0 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_readback.json"
grep -E "kvplan \(|decode step" "$W/long_fp8_readback.log"
step 45 short_fp4 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4.json"
grep -E "kvplan \(|decode step" "$W/short_fp4.log"
step 45 short_fp4_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp4 --hf "" --out "$W/short_fp4_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp4_plain.log"
step 45 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
grep -E "kvplan \(|decode step" "$W/short_fp8.log"
step 45 short_fp8_loop env KVPLAN_SEARCH_UNROLL=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_loop.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_loop.log"
step 45 short_fp8_plain env KVPLAN_KV_SCALE_SEARCH=0 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_plain.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_plain.log"
step 140 hc_sweep python3 bench/bench_dsv4_blocks.py --rows 32 --hc-rows 32 --sweep --out "$W/hc_sweep.json"
grep -A14 "hc_pre plans" "$W/hc_sweep.log"
