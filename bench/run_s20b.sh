#!/usr/bin/env bash
# Session 20, call B: the whole-tile loop mode 2 (page lookups a tile ahead, V's scales on the
# probabilities; kvplan.ops._paged_attention_kernels.PREFETCH_MODES): GPU tests of the paged
# kernels, the decode sweep per format with modes 0 and 2 at 32 x 8K, then the long fp8 engine
# workload with every launch in mode 2 against the default.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 150 gpu_paged python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/ops/test_paged_attention.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_paged.log" | head -20
step 200 sweep python3 bench/bench_quant_decode.py --graph --formats fp8,fp4,int8,bf16 --tiles 64 --warps 2,4 --stages 3,4,5 --prefetch 2 --splits "" --out "$W/sweep.json"
grep -E "^  (bf16|fp8|fp4|int8) " "$W/sweep.log"
for mode in 2 0; do
  KVPLAN_QUANT_PREFETCH=$mode step 80 long_fp8_m$mode python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_m$mode.json"
  grep -E "kvplan \(|decode step" "$W/long_fp8_m$mode.log"
done
