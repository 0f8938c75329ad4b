#!/usr/bin/env bash
# Prepared in session 22 (no device time left) for the next session's first call.
# The decode split plan counts resident programs (fp8 capped at 168 registers, int8 at its
# own 168: 3 splits at 32 x 8 heads). Two formats were never timed that way:
# 1. fp4 in prefetch mode 2 compiles to 168 registers (sm_90 here; 1,437 main-loop
#    instructions vs 1,579 in its default mode 1 at 244 registers): 6 programs an SM, so 3
#    splits would fill one wave. Time modes 0 / 1 / 2 at 2 and 3 splits, batch 32 and 16.
# 2. bf16 (164 registers at 2 warps: 6 an SM) at 3 splits vs its default 2.
# Then the GPU tests of the paged kernels.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 60 fp4_b32 python3 bench/bench_quant_decode.py --graph --formats fp4 --no-tiling --prefetch 1,2 --with-splits 2,3 --splits "" --out "$W/fp4_b32.json"
grep -E "^  " "$W/fp4_b32.log"
step 40 fp4_b16 python3 bench/bench_quant_decode.py --graph --formats fp4 --no-tiling --prefetch 2 --with-splits 3,6 --splits "" --batch 16 --out "$W/fp4_b16.json"
grep -E "^  " "$W/fp4_b16.log"
step 40 bf16_b32 python3 bench/bench_quant_decode.py --graph --formats bf16 --no-tiling --with-splits 2,3 --splits "" --out "$W/bf16_b32.json"
grep -E "^  " "$W/bf16_b32.log"
step 200 gpu_paged python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py tests/engine
grep -E "passed|failed|^FAILED|^E " "$W/gpu_paged.log" | head -20
