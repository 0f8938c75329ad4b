#!/usr/bin/env bash
# Session 39, call C: DeepSeek-V4 decode graphs by context tier and the top-k's parts of
# 4,096 columns. GPU tests of the hybrid graphs / async / top-k files; the top-k alone at
# 32 rows of 8,232 (8,192 eligible) and of 16,384 columns (the new default against the
# whole row); a 4K x 32 step under a 128K max_model_len with tiers (default) and without,
# and under a tight one; 32K x 32 profiled (the top-k in the step).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests hyb_tests 170 8 tests/engine/test_hybrid_graphs.py tests/engine/test_hybrid_async.py \
  tests/ops/test_topk.py tests/engine/test_hybrid_prefix_cache.py
step 60 topk python3 bench/bench_sparse_kernels.py --only topk --rows 32 --candidates 8192,16384 \
  --topk-width 8232 --out "$W/topk.json"
grep -E "^topk .*(old|'row': True, 'bits': 5\}|part': 4096, 'bits': 5)" "$W/topk.log" | cut -c1-140
for v in tiers:--max-model-len=131072 notiers:--max-model-len=131072 tight:--max-model-len=0; do
  name=d4k_${v%%:*}; extra=${v#*:}
  [ "${v%%:*}" = notiers ] && extra="$extra --no-tiers"
  step 50 $name python3 bench/bench_hybrid.py --batch 32 --contexts 4096 --formats fp8 \
    $extra --out "$W/$name.json"
  grep -E "^ *fp8 |async" "$W/$name.log"
done
step 90 p32k python3 bench/bench_hybrid.py --batch 32 --contexts 32768 --formats fp8 \
  --profile 2 --out "$W/p32k.json"
grep -E "^ *fp8 |async|_topk|expand" "$W/p32k.log" | head -12
