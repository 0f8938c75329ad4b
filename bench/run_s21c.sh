#!/usr/bin/env bash
# Session 21, call C: the hybrid decode step's sparse attention split on fp8 records
# (call B: fp8 241 / 417 us a step vs bf16 rows 165 / 245 at 32K / 128K, batch 32). A/B of
# the split target and tiling (KVPLAN_SPARSE_SPLIT=programs_per_sm,tile_n,warps,stages),
# fp8 at 32K and 128K, batch 32, in one call; bf16 rows at the default for reference.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
run() {  # name, env value ("" = default), formats
  KVPLAN_SPARSE_SPLIT=$2 step 60 "$1" python3 bench/bench_hybrid.py --contexts 32768,131072 --formats "$3" --out "$W/$1.json"
  grep -E "^ *(fp8|exact) .*(graphs|async)|^ +async" "$W/$1.log"
}
run fp8_default "" fp8
run exact_default "" exact
run fp8_2_32_4_3 2,32,4,3 fp8
run fp8_4_32_4_3 4,32,4,3 fp8
run fp8_2_64_4_3 2,64,4,3 fp8
run fp8_2_32_4_2 2,32,4,2 fp8
run fp8_1_64_8_3_again "" fp8
