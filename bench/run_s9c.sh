#!/usr/bin/env bash
# Prepared at the end of session 8: kernel sweeps for the hybrid prefill (a session-9 call):
# the sparse attention kernel on a prefill-shaped CSA case (8,192 rows sharing ring and pool
# keys) over tile_n x warps x stages, and the hyper-connection projection plans at 4,096 rows
# (IEEE vs tensor-core forms).
set -u
source bench/gpu_steps.sh
step 150 sparse_prefill python3 bench/bench_sparse_kernels.py --only attention --prefill-rows 8192 --out "$W/sparse_prefill.json"
grep -E "prefill" "$W/sparse_prefill.log" | sort -k10 -n | head -8
step 300 hc_sweep python3 bench/bench_dsv4_blocks.py --rows 4096 --hc-rows 4096 --sweep --out "$W/hc_sweep.json"
python3 -c "import json; d=json.load(open('$W/hc_sweep.json')); [print(r) for r in d.get('hc_pre_plans', [])[:12]]"
