#!/usr/bin/env bash
# Prepared in session 37 (the second call after bench/run_s38a.sh): the long workload
# (32 x 8,192 x 256) with fp4 and with int8 pages, one KV head a program vs two
# (KVPLAN_DECODE_HEADS; DECODE_TILING_HEADS' tilings), fp8's default beside them. If two
# heads win, add "e2m1_f16" / "int8" entries to DECODE_HEADS_AUTO at the bound call A finds.
set -u
BUDGET=${BUDGET:-500}
LONG_SECS=80
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for fmt in fp4 int8; do
  long_run "long_${fmt}_h1" "$fmt" KVPLAN_DECODE_HEADS=1
  long_run "long_${fmt}_h2" "$fmt" KVPLAN_DECODE_HEADS=2
done
long_run long_fp8 fp8
