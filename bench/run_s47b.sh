#!/usr/bin/env bash
# Session 47, call B: fresh prompts longer than the window on two flash calls merged by
# log-sum-exp (`windowed_fresh_attention`): the GPU tests of the window and the fresh-row
# paths (the engine test now an fp32 model); one 8K prompt's prefill (fp8, fp8 with the
# window, fp8 with the window on the paged kernel); the long fp8 workload with windows 0 / 64.
set -u
BUDGET=${BUDGET:-450}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests tests 150 4 -rP tests/engine/test_kv_exact_window.py \
  tests/backends/test_fresh_prefill_gpu.py tests/ops/test_paged_attention_ring.py
grep -E "^chunk " "$W/tests.log"
step 100 prefill python3 bench/profile_prefill.py --prompt-len 8192 --prompts 3 \
  --variants fp8,fp8-w64,fp8-paged --out "$W/prefill.json"
grep -E "ms per" "$W/prefill.log"
step 40 prefill_w64_paged env KVPLAN_PREFILL_FLASH=0 python3 bench/profile_prefill.py \
  --prompt-len 8192 --prompts 3 --variants fp8-w64 --out "$W/prefill_w64_paged.json"
grep -E "ms per" "$W/prefill_w64_paged.log"
for w in 64 0; do
  step 60 "long_w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window "$w" \
    --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_w$w.json"
  grep -E "kvplan \(|decode step" "$W/long_w$w.log"
done
