#!/usr/bin/env bash
# Prepared at the end of session 8 for the next session's first GPU call (hybrid model):
# the GPU tests of what session 8 changed after its last GPU call (tensor-core hc projection,
# host staging from numpy block tables, SDPA prefill), the projection forms side by side, the
# hybrid end to end vs HF (warm), the pipelined decode step at 4K / 32K / 128K.
set -u
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_hyper_connection.py tests/engine/test_hybrid_graphs.py tests/engine/test_hybrid_async.py tests/engine/test_deepseek_v4_engine.py tests/backends/test_hybrid_gpu_kernels.py tests/backends/test_fresh_prefill_gpu.py tests/backends/test_fresh_prefill.py tests/backends/test_sdpa_prefill.py tests/ops/test_topk.py
grep -E "passed|failed|^FAILED|^E  " "$W/gpu_tests.log" | head -20
step 60 hc python3 bench/bench_dsv4_blocks.py --hc-rows 32,4096,8192 --out "$W/blocks.json"
grep -E "hc_" "$W/hc.log"
step 200 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --out "$W/hybrid_hf.json"
tail -3 "$W/hybrid_hf.log"
step 150 hybrid python3 bench/bench_hybrid.py --contexts 4096,32768,131072 --formats fp8,exact --time-budget 120 --out "$W/hybrid.json"
grep -E "graphs|format" "$W/hybrid.log"; python3 -c "import json; [print(r['kv_format'], r['context'], 'pipelined', round(r.get('pipelined_ms', 0), 3)) for r in json.load(open('$W/hybrid.json'))['decode']]"
