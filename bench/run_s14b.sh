#!/usr/bin/env bash
# Session 14, call B: GPU tests of the defaults flipped after call A (hc projection's
# tensor-core form at every size, top-k part width by rows, 2-stage split on bf16 rows), the
# fused residual-update + connection at 32-256 rows under the new projection form, then
# where a decode step spends its time now: the hybrid step at batch 32 (32K, 128K; fp8 and
# bf16 rows) and the dense step at batch 64, each under the profiler.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 110 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_topk.py tests/ops/test_hyper_connection.py tests/ops/test_sparse_split.py tests/ops/test_sparse_attention.py tests/engine/test_deepseek_v4_engine.py tests/models
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -12
step 70 hc_rows python3 bench/bench_dsv4_blocks.py --hc-rows 32,64,128,256 --out "$W/hc_rows.json"
grep -E "hc_pre@|hc_post_pre@" "$W/hc_rows.log"
step 150 hybrid_prof python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp8,exact --profile 2 --time-budget 140 --out "$W/hybrid_prof.json"
grep -E "32768|131072|async|^ +[0-9]" "$W/hybrid_prof.log" | head -120
step 110 dense_prof python3 bench/profile_engine.py --out "$W/dense_prof"
tail -45 "$W/dense_prof.log"
