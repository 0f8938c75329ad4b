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
# fp8 vs bf16 KV where the KV reads weigh: batch 256 at 128K context (both fit; the index keys
# of 32K candidates per CSA layer and row dominate the step's reads)
step 200 hybrid_b256 python3 bench/bench_hybrid.py --batch 256 --contexts 131072 --formats fp8,exact --time-budget 180 --out "$W/hybrid_b256.json"
python3 -c "import json; [print(r['kv_format'], r['context'], r['batch'], r.get('step_ms'), r.get('pipelined_ms'), r.get('floor_ms'), r.get('skipped')) for r in json.load(open('$W/hybrid_b256.json'))['decode']]"
