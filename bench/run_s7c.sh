#!/usr/bin/env bash
# Session 7's last GPU call: GPU tests of what changed, the hybrid decode step and prefill
# profile after the kernel-count cuts, Gemma-3 vs HF, the quantized decode sweep, the dense
# prefill flash path and the long-context engine A/B; every log in one tarball.
set -u
source bench/gpu_steps.sh
step 120 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests
grep -E "passed|failed|^FAILED|^ERROR" "$W/gpu_tests.log" | tail -14
step 70 hybrid python3 bench/bench_hybrid.py --modes graphs --profile 1 --out "$W/hybrid.json"
grep -E "^ +(fp8|exact) |ALL KERNELS" "$W/hybrid.log"
step 150 hybrid_hf python3 bench/bench_hybrid_hf.py --no-hf --split --profile-prefill \
  --out "$W/hybrid_hf.json"
grep -E "kvplan |Error" "$W/hybrid_hf.log" | tail -3
step 120 gemma3 python3 bench/bench_gemma3.py --time-budget 105 --out "$W/gemma3.json"
tail -8 "$W/gemma3.log"
step 45 prefill python3 bench/bench_paged_attention.py --prefill-only --no-sweep \
  --prefill-shapes 32x8192 --out "$W/prefill.json"
tail -8 "$W/prefill.log"
for f in 0 1; do
  KVPLAN_PREFILL_FLASH=$f step 45 "long_flash$f" python3 bench/bench_engine.py --hf '' \
    --num-requests 32 --prompt-len 8192 --new-tokens 256 --out "$W/long_flash$f.json"
  grep -E "^kvplan" "$W/long_flash$f.log" | tail -1
done
step 25 dsv4_blocks python3 bench/bench_dsv4_blocks.py --out "$W/dsv4_blocks.json"
step 40 quant_decode python3 bench/bench_quant_decode.py --out "$W/quant_decode.json"
grep -vE "^ *$" "$W/quant_decode.log" | tail -10
