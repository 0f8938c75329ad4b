#!/usr/bin/env bash
# Session 27, call D: the hybrid workload (16 x 4,096 x 128, fp8, prompts alone too) with the
# prompt's index tables (KVPLAN_PROMPT_RANGES=0) and with the range kernel (pointer loads),
# alternating twice (call C: the same setting moved 2,862 -> 2,969 tok/s between calls), then
# the prefill profile on the range path.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
for i in 1 2; do
  for r in 0 1; do
    step 130 "e2e_r${r}_$i" env KVPLAN_PROMPT_RANGES=$r python3 bench/bench_hybrid_hf.py --split \
      --no-hf --kv-formats fp8 --out "$W/e2e_r${r}_$i.json"
    grep -E "kvplan " "$W/e2e_r${r}_$i.log" | tail -1
  done
done
step 100 prof_r1 env KVPLAN_PROMPT_RANGES=1 python3 bench/bench_hybrid_hf.py --split --no-hf \
  --kv-formats fp8 --profile-prefill --out "$W/prof_r1.json"
python3 -c "
import json; d = json.load(open('$W/prof_r1.json'))
for r in d['runs']:
    for k in r.get('prefill_profile', {}).get('self_device_time_total', [])[:12]: print(k)
"
