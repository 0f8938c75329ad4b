#!/usr/bin/env bash
# First device call of the session after session 11 (which ran out of device time before its
# last call): the GPU tests of session 11's changes, one 8K prompt's prefill with the stored
# rows read back by ops.read_slots, the hybrid end to end vs HF with the prefill's timeline
# (trace) and every timed step by kind, the 128K decode at batch 256 (where KV bytes, not
# weights, dominate the floor), and the long dense workload with the whole-workload warm-up.
set -u
source bench/gpu_steps.sh
step 90 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_read_slots.py tests/ops/test_index_scores_seq.py tests/ops/test_compress_store.py tests/models/test_deepseek_v4_fused_compress.py tests/engine/test_cli_bench.py tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py tests/backends/test_hybrid_gpu_kernels.py tests/engine/test_deepseek_v4_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 40 prefill python3 bench/profile_prefill.py --variants fp8,fp4,fp4-paged --prompts 3 --top 8 --out "$W/prefill.json"
grep -E "per 8192" "$W/prefill.log"
step 165 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --trace "$O" --out "$W/hybrid_hf.json"
grep -E "tok/s" "$W/hybrid_hf.log"
python3 -c "import json; d=json.load(open('$W/hybrid_hf.json')); [print(r.get('kv_format'), r.get('steps_by_kind'), len(r.get('triton_compiles_in_run') or [])) for r in d['runs'] if r.get('kv_format')]"
step 70 hybrid_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --out "$W/hybrid_b256.json"
grep -E "131072" "$W/hybrid_b256.log" | tail -4
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
grep -E "kvplan \(|decode step|compiles" "$W/long_fp8.log"
step 85 long_bf16 python3 bench/bench_engine.py --kv-format bf16 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_bf16.json"
grep -E "kvplan \(|decode step|compiles" "$W/long_bf16.log"
