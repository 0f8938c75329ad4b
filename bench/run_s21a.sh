#!/usr/bin/env bash
# Prepared in session 20 for the next session's first call: the GPU suite (session 20 made mode
# 2 the fp8 / int8 decode default and sends one-query prefill rows to the decode kernel, the
# latter unmeasured on the GPU), then that routing A/B on the long and short workloads
# (KVPLAN_ONE_QUERY_ROWS_DECODE=1 / 0, fp8 and bf16), then where the short workload's fp8
# prefill steps spend their time against bf16 (session 20 call C: 95 vs 73 ms).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 250 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
for f in fp8 bf16; do
  for r in 1 0; do
    KVPLAN_ONE_QUERY_ROWS_DECODE=$r step 45 long_${f}_r$r python3 bench/bench_engine.py --kv-format $f --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_${f}_r$r.json"
    grep -E "kvplan \(|decode step" "$W/long_${f}_r$r.log"
  done
done
step 60 prefill_prof python3 bench/profile_prefill.py --prompt-len 256 --workload 64,128 --variants bf16,fp8 --top 12 --out "$W/prefill_prof.json"
tail -32 "$W/prefill_prof.log"
