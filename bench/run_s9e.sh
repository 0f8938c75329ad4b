#!/usr/bin/env bash
# Session 9, mid-session call: GPU tests of the in-place hybrid prefill (compressed entries
# read from their pools, bf16 window rows) and the split kernel's 64-key tiles; the hybrid end
# to end vs HF with its prefill profile and step counts; the decode step at 32K.
set -u
source bench/gpu_steps.sh
step 90 gpu_tests python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/backends/test_hybrid_gpu_kernels.py tests/backends/test_hybrid_planned.py tests/engine/test_deepseek_v4_engine.py tests/ops/test_sparse_split.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | tail -5
step 150 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --out "$W/hybrid_hf.json"
tail -3 "$W/hybrid_hf.log"
python3 -c "import json; d=json.load(open('$W/hybrid_hf.json')); [print(e['name'][:60], round(e['ms'],2), e['calls']) for r in d['runs'] if r.get('kv_format')=='fp8' for e in r['prefill_profile']['self_device_time_total'][:14]]"
step 50 hybrid python3 bench/bench_hybrid.py --contexts 32768 --formats fp8,exact --time-budget 40 --out "$W/hybrid.json"
python3 -c "import json; [print(r['kv_format'], r['context'], 'serial', round(r['step_ms'], 3), 'pipelined', round(r.get('pipelined_ms', 0), 3)) for r in json.load(open('$W/hybrid.json'))['decode']]"
