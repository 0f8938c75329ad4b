#!/usr/bin/env bash
# (Never ran: the device refused every start after call B; call D replaced it, and the
# two-flash mode it compares was removed after call B: bench/RESULTS.md, session 47.)
# Session 47, call C: the window's long fresh prompts, two flash calls merged by log-sum-exp
# (KVPLAN_WINDOW_FRESH=flash) against the stored rows as bf16 pages with the new rows as the
# ring (=rows): the GPU engine test in both modes, one 8K prompt's prefill in each, then the
# long fp8 workload with the window in the faster mode.
set -u
BUDGET=${BUDGET:-200}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 70 2 -rP tests/engine/test_kv_exact_window.py -k cuda_chunked
grep -E "chunk " "$W/tests.log"
for m in flash rows; do
  step 35 "prefill_$m" env KVPLAN_WINDOW_FRESH=$m python3 bench/profile_prefill.py \
    --prompt-len 8192 --prompts 3 --variants fp8-w64 --top 6 --out "$W/prefill_$m.json"
  grep -E -A6 "ms per" "$W/prefill_$m.log"
done
best=$(for m in flash rows; do echo "$(grep -oE '[0-9.]+ ms per' "$W/prefill_$m.log" | head -1 | cut -d' ' -f1) $m"; done | sort -n | head -1 | cut -d' ' -f2)
echo "faster: $best"
step 60 long_w64 env KVPLAN_WINDOW_FRESH="$best" python3 bench/bench_engine.py --kv-format fp8 \
  --kv-exact-window 64 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" \
  --out "$W/long_w64.json"
grep -E "kvplan \(|decode step" "$W/long_w64.log"
