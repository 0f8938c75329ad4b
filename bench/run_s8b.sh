#!/usr/bin/env bash
# Session 8, second GPU call: the GPU suite (verbose: failing names as they happen), the hybrid
# end to end under cProfile (where fp8's extra decode time goes), the pipelined hybrid decode
# step at 32K, kvplan's Gemma-3 run with both sliding_window_kv batches.
set -u
source bench/gpu_steps.sh
step 200 gpu_tests python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider tests
grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | grep -v "PASSED" | tail -12
step 90 hybrid32k python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --profile 1 --time-budget 60 --out "$W/hybrid32k.json"
grep -vE "^ {4}" "$W/hybrid32k.log" | tail -8
step 150 hybrid_hf python3 bench/bench_hybrid_hf.py --no-hf --cprofile --out "$W/hybrid_hf.json"
tail -3 "$W/hybrid_hf.log"
step 150 gemma3 python3 bench/bench_gemma3.py --hf "" --time-budget 140 --out "$W/gemma3.json"
tail -6 "$W/gemma3.log"
