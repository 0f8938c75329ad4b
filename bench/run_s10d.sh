#!/usr/bin/env bash
# Last call, if device time remains after run_s10 / s10b / s10c: the sparse prefill kernel with
# its key tiles loaded a step ahead, the whole GPU suite (run_s10 and the benches above carry
# the targeted tests of this session's kernels), and the long fp4 workload with the prefetch
# switch on.
set -u
source bench/gpu_steps.sh
step 60 sparse_prefill python3 bench/bench_sparse_kernels.py --only prefill --prefill-short --out "$W/sparse_prefill.json"
grep -E "FASTEST|prefetch" "$W/sparse_prefill.log" | tail -6
step 250 gpu_suite python3 -m pytest -v -m gpu -n 12 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED" "$W/gpu_suite.log" | tail -12
step 90 long_fp4_pf env KVPLAN_QUANT_PREFETCH=1 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4_pf.json"
tail -3 "$W/long_fp4_pf.log"
