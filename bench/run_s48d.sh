#!/usr/bin/env bash
# Session 48, call D (the last ~280 s of device time): the long workload (32 x 8,192 x 256)
# with 10 GiB of KV, where the bf16 cache holds all 32 sequences (8 GiB, bench_engine's
# default, holds 16,384 blocks: 30 of them at full length, so the last ones decode alone
# afterwards), bf16 then fp8: fp8 against bf16 at equal concurrency.
set -u
BUDGET=${BUDGET:-130}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for fmt in bf16 fp8; do
  step 62 "l_${fmt}_10g" python3 bench/bench_engine.py --kv-format "$fmt" --num-requests 32 \
    --prompt-len 8192 --new-tokens 256 --hf "" --kv-cache-memory 10737418240 \
    --out "$W/l_${fmt}_10g.json"
  grep -E "blocks|kvplan \(|decode step" "$W/l_${fmt}_10g.log"
done
