#!/usr/bin/env bash
# Second call: the whole GPU suite, the hybrid decode step at 4K / 32K / 128K, and the dense
# long workload with fp8 vs fp4 KV (fp4 >= fp8 is issue 17's target).
set -u
source bench/gpu_steps.sh
step 240 gpu_suite python3 -m pytest -v -m gpu -n 12 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12
step 120 hybrid python3 bench/bench_hybrid.py --contexts 4096,32768,131072 --formats fp8,exact --time-budget 100 --out "$W/hybrid.json"
python3 -c "import json; [print(r['kv_format'], r['context'], 'serial', round(r['step_ms'], 3), 'pipelined', round(r.get('pipelined_ms', 0), 3), 'floor', round(r['floor_ms'], 3)) for r in json.load(open('$W/hybrid.json'))['decode']]"
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
tail -3 "$W/long_fp8.log"
step 80 long_fp4 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4.json"
tail -3 "$W/long_fp4.log"
