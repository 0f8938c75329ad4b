#!/usr/bin/env bash
# (Never ran: every start was refused until call C, which ran its A/Bs; the switches it sets were
# removed after call C measured them: see bench/RESULTS.md, session 46.)
# Session 46, call A: fp8 pages read as fp16 tiles in the dense decode kernel
# (KVPLAN_FP8_F16_KEYS: keys and values normalized per row, the row's scale on its logits / in
# the softmax's exponent): GPU tests of the new path, the kernel alone against the default at
# the long and short workloads' shapes, then the long and short workloads with the flag off / on.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests kern 100 8 tests/ops/test_paged_attention_quantized.py
step 120 eng env KVPLAN_FP8_F16_KEYS=1 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py \
  tests/engine/test_cuda_graphs.py tests/engine/test_kv_exact_window.py
tail -3 "$W/eng.log"
step 90 q8k python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --splits "" \
  --fp8-f16 --heads 2 --maxnreg 168 --out "$W/q8k.json"
grep -E "^ +fp8 " "$W/q8k.log"
step 60 q320 python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --splits "" \
  --fp8-f16 --batch 64 --context 320 --out "$W/q320.json"
grep -E "^ +fp8 " "$W/q320.log"
for f in 0 1; do long_run "l$f" fp8 KVPLAN_FP8_F16_KEYS=$f; done
for f in 0 1; do short_run "s$f" fp8 KVPLAN_FP8_F16_KEYS=$f; done
