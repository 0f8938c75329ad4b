#!/usr/bin/env bash
# Session 21, call E: the register cap with more splits. Call D swept the split count only on
# the uncapped launch; at 32 x 8K the default grid (512 programs) already fits 4 programs an
# SM, so a cap can only help with more programs: cap 168 (6 an SM) x 3 splits (768 programs).
set -u
BUDGET=${BUDGET:-150}
source bench/gpu_steps.sh
step 140 cap_splits python3 bench/bench_quant_decode.py --graph --formats fp8,fp4 --no-tiling --maxnreg 168 --with-splits 2,3 --splits "" --out "$W/cap_splits.json"
grep -E "^  " "$W/cap_splits.log" | head -20
