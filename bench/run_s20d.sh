#!/usr/bin/env bash
# Session 20, call D (the last ~8 device minutes): the GPU tests cut short in call C, fp4's
# mode 2 (page lookups ahead, V dequantized in registers) against its mode 1 default, and where
# the short workload's fp8 prefill steps spend their time against bf16 (call C: 95 vs 73 ms).
set -u
BUDGET=${BUDGET:-320}
source bench/gpu_steps.sh
step 190 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf -k "quantiz or paged or fp8 or int8 or fp4 or kv_format" tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
step 60 fp4 python3 bench/bench_quant_decode.py --graph --formats fp4 --tiles 64 --warps 2 --stages 2,3,4 --prefetch 1,2 --splits "" --out "$W/fp4.json"
grep -E "^  fp4 " "$W/fp4.log"
step 70 prefill_prof python3 bench/profile_prefill.py --workload 64,128 --variants bf16,fp8 --top 12 --out "$W/prefill_prof.json"
tail -40 "$W/prefill_prof.log"
