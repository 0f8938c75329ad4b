#!/usr/bin/env bash
# (Ran as call D at 5d97152 with BUDGET=95, ~16:17 UTC, after two refused tries; three
# single-command workload runs followed on the same warm machine: bench/RESULTS.md, session 47.)
# Session 47, call D (the device time left after failed starts: ~110 s): the stored rows as
# bf16 pages with the new rows as the ring (KVPLAN_WINDOW_FRESH=rows) on the GPU: its engine
# test, then one 8K prompt's prefill with the window in that mode and on the quantized pages
# (=0), side by side.
set -u
BUDGET=${BUDGET:-110}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for m in rows 0; do
  step 35 "prefill_$m" env KVPLAN_WINDOW_FRESH=$m python3 bench/profile_prefill.py \
    --prompt-len 8192 --prompts 3 --variants fp8-w64 --top 5 --out "$W/prefill_$m.json"
  grep -E -A5 "ms per" "$W/prefill_$m.log"
done
gpu_tests tests 40 1 -rP tests/engine/test_kv_exact_window.py -k "cuda_chunked and rows"
grep -E "chunk " "$W/tests.log"
