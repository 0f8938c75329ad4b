#!/usr/bin/env bash
# Second call: the hybrid decode step at 4K / 32K / 128K; the dense long workload with fp8 vs
# fp4 KV (fp4 >= fp8 is issue 17's target; prefill now on SDPA over the stored rows); the
# quantized decode kernels with the bytes loaded a tile ahead, and the long fp8 workload with
# that switch on.
set -u
source bench/gpu_steps.sh
step 120 hybrid python3 bench/bench_hybrid.py --contexts 4096,32768,131072 --formats fp8,exact --time-budget 100 --out "$W/hybrid.json"
python3 -c "import json; [print(r['kv_format'], r['context'], 'serial', round(r['step_ms'], 3), 'pipelined', round(r.get('pipelined_ms', 0), 3), 'floor', round(r['floor_ms'], 3)) for r in json.load(open('$W/hybrid.json'))['decode']]"
step 80 long_fp8 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8.json"
tail -3 "$W/long_fp8.log"
step 80 long_fp4 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4.json"
tail -3 "$W/long_fp4.log"
step 90 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --tiles 32,64 --warps 4 --stages 2,5 --prefetch --splits 2,4 --out "$W/quant_decode.json"
tail -10 "$W/quant_decode.log"
step 80 long_fp8_pf env KVPLAN_QUANT_PREFETCH=1 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_pf.json"
tail -3 "$W/long_fp8_pf.log"
