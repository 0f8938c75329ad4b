#!/usr/bin/env bash
# Prepared at the end of session 7 for the next session's first GPU call: the GPU suite with
# failing test names, the hybrid prefill after the in-place indexer fix (end to end vs HF),
# kvplan's Gemma-3 run (HF's best mode only), the quantized decode tiling sweep.
set -u
source bench/gpu_steps.sh
step 150 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_tests.log" | tail -20
step 200 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --out "$W/hybrid_hf.json"
grep -E "hf |kvplan |Error" "$W/hybrid_hf.log" | tail -4
step 90 gemma3 python3 bench/bench_gemma3.py --hf generate --time-budget 85 --out "$W/gemma3.json"
tail -8 "$W/gemma3.log"
step 45 quant_decode python3 bench/bench_quant_decode.py --out "$W/quant_decode.json"
grep -vE "^ *$" "$W/quant_decode.log" | tail -10
step 40 probe_sdpa python3 bench/probe_sdpa.py --out "$W/probe_sdpa.json"
cat "$W/probe_sdpa.log" | tail -20
