#!/usr/bin/env bash
# For session 43's first call: the whole GPU suite with the fused block norms on by default
# (session 42's suite ran at a commit where KVPLAN_HC_FUSED_NORM was still off; only the
# norm's own GPU tests and the benchmark steps ran it on), then the 32K x 32 fp8 decode step
# with the norms fused and apart, alternating, and a sweep of hc_pre's projection programs
# at 32 rows, on whatever card is lent.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 340 14 tests
decode_ab KVPLAN_HC_FUSED_NORM d32k_n 1 0 1 0 1 0
# hc_pre at a decode step's 32 rows over fewer projection programs: session 12 swept the
# targets at 256 rows only, and at 32 rows the default (256) gives the cap of 64 splits,
# whose partials hc_pre_kernel then sums per token (the Sinkhorn program's critical path?)
step 60 hc_proj32 python3 bench/bench_dsv4_blocks.py --rows 32 \
  --proj-programs 8,16,32,64,128,256 --out "$W/hc_proj32.json"
grep -iE "programs|splits" "$W/hc_proj32.log" | head -12
