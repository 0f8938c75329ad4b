#!/usr/bin/env bash
# Session 39, call B: issue 14's hybrid decode after the window expansion's int32 wrap
# (profiled: the expansion was 21.5 us a launch at 32K x 32 on the H200), the top-k at the
# width a captured step uses (rows max_model_len // 4 wide, 8,192 eligible), a 4K x 32 step
# under a tight and a 128K max_model_len (every captured width follows max_model_len), and
# 128K x 256, fp8 records against bf16 rows.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 60 topk python3 bench/bench_sparse_kernels.py --only topk --rows 32 --candidates 8192 \
  --topk-width 8232 --out "$W/topk.json"
grep -E "^topk" "$W/topk.log" | cut -c1-140
step 110 p32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8,exact \
  --profile 2 --out "$W/p32k.json"
grep -E "^ *(fp8|exact) |async|expand|topk" "$W/p32k.log" | head -30
for m in 0 131072; do  # the same 4K x 32 step under a tight and a 128K max_model_len
  step 45 d4k_m$m python3 bench/bench_hybrid.py --batch 32 --contexts 4096 --formats fp8 \
    --max-model-len $m --profile 1 --out "$W/d4k_m$m.json"
  grep -E "^ *fp8 |async" "$W/d4k_m$m.log"
done
step 150 d128k python3 bench/bench_hybrid.py --batch 256 --contexts 131072 --formats fp8,exact \
  --out "$W/d128k.json"
grep -E "^ *(fp8|exact) |async" "$W/d128k.log"
