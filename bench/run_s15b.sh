#!/usr/bin/env bash
# Session 15, call B: GPU tests of this session's fusions (the qkv epilogue's K/V store, the
# sparse attention's out_rope epilogue, q_b GEMM with the indexer's), then each measured
# against its A/B switch, back to back: the dense decode step / end to end, the hybrid decode
# step (batch 32, 32K) and the hybrid end to end against HF.
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 130 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/models tests/ops/test_sparse_split.py tests/ops/test_sparse_attention.py tests/ops/test_sparse_tiling.py tests/engine tests/backends
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -14
step 90 dense_off env KVPLAN_FUSED_KV_STORE=0 python3 bench/bench_engine.py --hf "" --out "$W/dense_off.json"
grep -E "tok/s|decode step" "$W/dense_off.log" | tail -3
step 120 dense_hf python3 bench/bench_engine.py --out "$W/dense_hf.json"
grep -E "tok/s|x HF|kvplan|HF |decode step" "$W/dense_hf.log" | tail -6
step 70 hyb_off env KVPLAN_FUSED_OUT_ROPE=0 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_off.json"
grep -E "fp8 |async" "$W/hyb_off.log"
step 70 hyb_on python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --out "$W/hyb_on.json"
grep -E "fp8 |async" "$W/hyb_on.log"
step 200 hybrid_hf python3 bench/bench_hybrid_hf.py --split --out "$W/hybrid_hf.json"
grep -E "tok/s|x HF|kvplan|HF " "$W/hybrid_hf.log" | tail -8
