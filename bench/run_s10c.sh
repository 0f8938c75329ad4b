#!/usr/bin/env bash
# Third call: the split-K Triton GEMM (kvplan.ops.skinny_gemm, KVPLAN_SKINNY_GEMM) against
# cuBLAS on every projection shape of the two benchmark models at 16 / 32 / 64 rows, then the
# decode steps with the switch off and on, side by side: the dense engine (llama-1b, 64 x 256 x
# 128) and the hybrid decode step at 32K; the sparse decode attention with its key tiles
# loaded a step ahead (prefetch=True) against the default launch.
set -u
source bench/gpu_steps.sh
step 200 skinny python3 bench/bench_skinny_gemm.py --time-budget 180 --out "$W/skinny.json"
grep -E "x +[0-9]+ M=" "$W/skinny.log" | tail -40
step 60 engine_off env KVPLAN_SKINNY_GEMM=0 python3 bench/bench_engine.py --hf "" --out "$W/engine_off.json"
tail -3 "$W/engine_off.log"
step 60 engine_on env KVPLAN_SKINNY_GEMM=1 python3 bench/bench_engine.py --hf "" --out "$W/engine_on.json"
tail -3 "$W/engine_on.log"
step 70 hybrid_off env KVPLAN_SKINNY_GEMM=0 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --time-budget 50 --out "$W/hybrid_off.json"
step 70 hybrid_on env KVPLAN_SKINNY_GEMM=1 python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --time-budget 50 --out "$W/hybrid_on.json"
step 60 sparse python3 bench/bench_sparse_kernels.py --only attention --out "$W/sparse.json"
grep -E "FASTEST|prefetch" "$W/sparse.log" | tail -12
for f in hybrid_off hybrid_on; do python3 -c "import json; [print('$f', r['kv_format'], r['context'], 'serial', round(r['step_ms'], 3), 'pipelined', round(r.get('pipelined_ms', 0), 3)) for r in json.load(open('$W/$f.json'))['decode']]"; done
