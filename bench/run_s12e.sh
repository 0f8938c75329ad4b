#!/usr/bin/env bash
# Fifth call: the 128K batch-256 decode's four slow kernels (call 4: index scores 4.1 ms,
# sparse attention 2.9, hc projection 1.3, top-k 0.9 of 12.0 ms of kernels) swept at their
# real shapes and the new decode projection plan (one K tile a program) tested and timed; the
# winners go into the defaults afterwards; last, the decode step at 128K batch 256 with the new
# projection plan (kernel table).
set -u
BUDGET=${BUDGET:-500}
source bench/gpu_steps.sh
step 80 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf tests/ops/test_hyper_connection.py tests/ops/test_hyper_connection_fused.py tests/ops/test_topk.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -8
step 40 hc_proj python3 bench/bench_dsv4_blocks.py --rows 256 --proj-programs 128,256,512,1024 --out "$W/hc_proj.json"
grep -E "projection target" "$W/hc_proj.log"
step 70 index256 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --index-kinds mxfp8 --only index --sweep --out "$W/index256.json"
grep -E "FASTEST|old  |new  " "$W/index256.log" | tail -4
step 50 topk256 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --only topk --out "$W/topk256.json"
grep -E "FASTEST|old  " "$W/topk256.log" | tail -3
step 90 attn256 python3 bench/bench_sparse_kernels.py --rows 256 --only attention --attention-sweep stages --hca-entries 1024 --out "$W/attn256.json"
grep -E "FASTEST|old  " "$W/attn256.log" | tail -4
step 40 index32 python3 bench/bench_sparse_kernels.py --rows 32 --candidates 8192 --index-kinds mxfp8 --only index --sweep --out "$W/index32.json"
grep -E "FASTEST" "$W/index32.log" | tail -2
step 40 topk32 python3 bench/bench_sparse_kernels.py --rows 32 --candidates 8192 --only topk --out "$W/topk32.json"
grep -E "FASTEST" "$W/topk32.log" | tail -2
step 60 hybrid_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --profile 1 --out "$W/hybrid_b256.json"
grep -E "131072|ALL KERNELS|hc_proj|index_scores|sparse_att|topk" "$W/hybrid_b256.log" | head -16
