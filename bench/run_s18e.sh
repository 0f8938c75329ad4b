#!/usr/bin/env bash
# Session 18, call E: decode attention tilings across contexts (call D: at 64 x 320, bf16 pages
# took 13.1 us with 2 warps / 2 stages against 16.2 with the default 4 / 5), and the dense
# engine with that tiling (KVPLAN_DECODE_TILING) against the default, side by side.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
for ctx in 1024 4096; do
  step 35 dec_$ctx python3 bench/bench_quant_decode.py --batch 64 --context $ctx --formats bf16,fp8 --graph --splits 1 --tiles 64 --warps 2,4 --stages 2,3,5 --out "$W/dec_$ctx.json"
  grep -A6 "^format" "$W/dec_$ctx.log"
done
step 60 dec_8192 python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats bf16,fp8 --graph --splits 1,2 --tiles 64 --warps 2,4 --stages 2,3,5 --out "$W/dec_8192.json"
grep -E "bf16 \{|fp8 \{|default" "$W/dec_8192.log" | tail -24
step 40 short_bf16_t225 env KVPLAN_DECODE_TILING=64,2,2 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_t225.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_t225.log"
step 40 short_bf16_dflt python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_dflt.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_dflt.log"
step 40 short_bf16_t225b env KVPLAN_DECODE_TILING=64,2,2 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_t225b.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_t225b.log"
step 40 short_bf16_dfltb python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16_dfltb.json"
grep -E "kvplan \(|decode step" "$W/short_bf16_dfltb.log"
