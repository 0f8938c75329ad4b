#!/usr/bin/env bash
# Prepared in session 29 for the next session's first call. Session 29's last GPU run came
# before two changes: the lean launcher's first-launch fix and the kernels that no longer
# specialize on step sizes (kvplan/ops/_launch.py "Sizes"; checked on the CPU only). So: their
# tests, the first-request latency of new prompt lengths after a warm run with sizes
# unspecialized (default) and specialized (KVPLAN_SPECIALIZE_SIZES=1; call A of session 29:
# 8.95 s for the first 8-token prompt), the decode step both ways, the dense long fp8 decode.
# The whole suite is bench/run_s30b.sh (it needs its own call).
set -u
BUDGET=${BUDGET:-570}
source bench/gpu_steps.sh
step 70 touched python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf \
  tests/ops/test_lean_launch.py tests/ops/test_hyper_connection.py \
  tests/ops/test_hyper_connection_rows.py tests/ops/test_store.py tests/ops/test_load.py \
  tests/ops/test_sparse_ranges.py tests/ops/test_swa_index.py tests/ops/test_convert_kv_index.py \
  tests/ops/test_kv_ca_index.py tests/ops/test_kv_index_cat.py tests/plan \
  tests/backends/test_hybrid_gpu_kernels.py
tail -3 "$W/touched.log"
for s in 0 1; do
  # an empty Triton cache each: neither process may reuse the other's (or the tests') compiles
  step 160 first$s env KVPLAN_SPECIALIZE_SIZES=$s TRITON_CACHE_DIR="$(mktemp -d)" \
    python3 bench/hybrid_steps.py --profile "" \
    --num-requests 4 --prompt-len 2048 --new-tokens 16 --small 8,9,17,23,40,100 \
    --out "$W/first$s.json"
  grep -E "^one|^warm" "$W/first$s.log"
done
for s in 0 1; do
  hybrid_decode dec4k$s 16 4096 KVPLAN_SPECIALIZE_SIZES=$s
done
hybrid_decode dec32k 32 32768
step 60 long python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 \
  --new-tokens 256 --hf "" --out "$W/long.json"
grep -E "kvplan \(|decode step" "$W/long.log"
