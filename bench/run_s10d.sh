#!/usr/bin/env bash
# Fourth call: quantized decode with each tile's bytes loaded a tile ahead (QUANT_PREFETCH):
# the kernel sweep, then the dense long workload with fp8 / fp4 KV with the switch on (compare
# with run_s10b's long_fp8 / long_fp4, switch off).
set -u
source bench/gpu_steps.sh
step 90 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --tiles 32,64 --warps 4 --stages 2,5 --prefetch --splits 2,4 --out "$W/quant_decode.json"
tail -10 "$W/quant_decode.log"
step 60 gpu_tests python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/ops/test_skinny_gemm.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | tail -5
step 90 long_fp8_pf env KVPLAN_QUANT_PREFETCH=1 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_pf.json"
tail -3 "$W/long_fp8_pf.log"
step 90 long_fp4_pf env KVPLAN_QUANT_PREFETCH=1 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4_pf.json"
tail -3 "$W/long_fp4_pf.log"
