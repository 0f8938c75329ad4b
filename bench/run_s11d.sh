#!/usr/bin/env bash
# Session 11, last device call: the GPU tests of this session's changes (read_slots kernel,
# compile recorder, prefetch tests at one ulp, fp4 decode prefetching by default in the
# engine), one 8K prompt's prefill with the stored rows read back by the new kernel, and the
# long dense workload with the whole-workload warm-up and its compile count.
set -u
source bench/gpu_steps.sh
step 40 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_read_slots.py tests/engine/test_cli_bench.py tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 35 prefill python3 bench/profile_prefill.py --variants fp8,fp4,fp4-paged --prompts 3 --top 8 --out "$W/prefill.json"
grep -E "per 8192" "$W/prefill.log"
step 60 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
grep -E "kvplan \(|decode step|compiles" "$W/long_fp8.log"
