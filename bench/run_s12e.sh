#!/usr/bin/env bash
# Prepared in session 12 after its last GPU call (every later request for a machine was
# refused): the sparse kernels' constexpr block sizes (no software int64 division per key row)
# tested and timed, the hybrid decode steps and the end to end vs HF again, then the 128K
# batch-256 decode's slow kernels swept at their real shapes (14:33 UTC: index scores 4.1 ms,
# sparse attention 2.9, hc projection 1.3, top-k 0.9 of 12.0 ms of kernels), incl. the
# opt-in compacting top-k and the new decode projection plan (one K tile a program).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
# a step that is worth nothing cut short: skipped unless its whole time is left
step_whole() { if [ "$(left)" -lt "$1" ]; then echo "$2: skipped (budget)"; else step "$@"; fi; }
step 60 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_sparse_attention.py tests/ops/test_sparse_split.py tests/ops/test_index_scores_seq.py tests/backends/test_hybrid_gpu_kernels.py tests/engine/test_deepseek_v4_engine.py tests/ops/test_hyper_connection_fused.py tests/ops/test_topk.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -8
step 55 hybrid_b256 python3 bench/bench_hybrid.py --contexts 131072 --batch 256 --formats fp8,exact --profile 1 --out "$W/hybrid_b256.json"
grep -E "131072|ALL KERNELS|hc_proj|index_scores|sparse_att|topk" "$W/hybrid_b256.log" | head -16
step_whole 125 e2e python3 bench/bench_hybrid_hf.py --split --out "$W/e2e.json"
grep -E "tok/s" "$W/e2e.log"
step 40 hybrid_b32 python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --profile 1 --out "$W/hybrid_b32.json"
grep -E "^ +(fp8|exact) |ALL KERNELS" "$W/hybrid_b32.log" | head -12
step 35 topk256 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --only topk --out "$W/topk256.json"
grep -E "FASTEST|old  " "$W/topk256.log" | tail -3
step 60 index256 python3 bench/bench_sparse_kernels.py --rows 256 --candidates 32768 --index-kinds mxfp8 --only index --sweep --out "$W/index256.json"
grep -E "FASTEST|old  |new  " "$W/index256.log" | tail -4
step 35 hc_proj python3 bench/bench_dsv4_blocks.py --rows 256 --proj-programs 128,256,512,1024 --out "$W/hc_proj.json"
grep -E "projection target" "$W/hc_proj.log"
step 80 attn256 python3 bench/bench_sparse_kernels.py --rows 256 --only attention --attention-sweep stages --hca-entries 1024 --out "$W/attn256.json"
grep -E "FASTEST|old  " "$W/attn256.log" | tail -4
step 60 attn32 python3 bench/bench_sparse_kernels.py --only attention --attention-sweep stages --out "$W/attn32.json"
grep -E "FASTEST|old  " "$W/attn32.log" | tail -4
step 60 index32 python3 bench/bench_sparse_kernels.py --rows 32 --candidates 8192 --index-kinds mxfp8 --only index --sweep --out "$W/index32.json"
grep -E "FASTEST" "$W/index32.log" | tail -2
