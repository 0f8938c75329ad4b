#!/usr/bin/env bash
# Session 10's CPU-only work, first GPU call of the next session: GPU tests of what changed
# (the Triton pair grouping of the grouped MoE, hc_pre rows with the explicit fma sequence on
# by default, SDPA / flash on a quantized cache's fresh prefill rows), the sweeps that show
# their effect, and the hybrid end to end vs HF.
set -u
source bench/gpu_steps.sh
step 130 gpu_tests python3 -m pytest -v -m gpu -n 12 -p no:cacheprovider --tb=short -rf tests/ops/test_hyper_connection_rows.py tests/ops/test_moe_grouped.py tests/ops/test_moe_grouped_plans.py tests/models/test_deepseek_v4_moe_grouped.py tests/backends/test_fresh_prefill_gpu.py tests/engine/test_quantized_kv_engine.py tests/ops/test_sparse_tiling.py tests/backends/test_hybrid_gpu_kernels.py tests/engine/test_deepseek_v4_engine.py tests/ops/test_skinny_gemm.py tests/ops/test_paged_attention_quantized.py tests/ops/test_sparse_split.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | tail -8
step 40 moe python3 bench/bench_dsv4_blocks.py --moe-sweep --moe-rows 8192 --out "$W/moe.json"
grep -E "group_pairs|whole|old|default|best" "$W/moe.log" | tail -8
step 35 hc python3 bench/bench_dsv4_blocks.py --hc-rows 8192 --out "$W/hc.json"
grep -E "rows|faster|slower|equal" "$W/hc.log" | tail -8
step 200 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --out "$W/hybrid_hf.json"
tail -4 "$W/hybrid_hf.log"
python3 -c "import json; d=json.load(open('$W/hybrid_hf.json')); [print(r.get('kv_format'), e['name'][:50], round(e['ms'],2), e['calls']) for r in d['runs'] if r.get('kv_format') for e in r['prefill_profile']['self_device_time_total'][:12]]"
step 60 short_bf16 python3 bench/bench_engine.py --kv-format bf16 --hf "" --out "$W/short_bf16.json"
tail -3 "$W/short_bf16.log"
step 60 short_fp8 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8.json"
tail -3 "$W/short_fp8.log"
