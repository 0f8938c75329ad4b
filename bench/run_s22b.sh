#!/usr/bin/env bash
# Session 22, call B. Call A's GPU suite ran past its 230 s (two failures, names unknown) and
# the long fp8 workload with KVPLAN_DECODE_FUSED_COMBINE=1 past its 48 s: slow compiles or a
# hang? In order:
# 1. The fused-merge GPU tests alone, verbose, with faulthandler stacks after 90 s.
# 2. The rest of the GPU suite, verbose (per-test lines survive a timeout).
# 3. The long fp8 workload with the dense fused merge (longer timeout), and the default.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
FUSED_TESTS="tests/ops/test_paged_attention_quantized.py::test_gpu_fused_decode_merge_equals_combine_kernel tests/ops/test_sparse_split.py::test_cuda_fused_merge_equals_combine_kernel_and_replays"
step 150 fused_tests python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -o faulthandler_timeout=90 $FUSED_TESTS --durations=10
grep -E "PASSED|FAILED|ERROR|Timeout|File \"|slowest|s call|passed|failed" "$W/fused_tests.log" | head -60
desel=""; for t in $FUSED_TESTS; do desel="$desel --deselect $t"; done
step 280 gpu_suite python3 -m pytest -v -m gpu -n 14 -p no:cacheprovider --tb=short -rf -o faulthandler_timeout=150 tests $desel
grep -E "FAILED|^E |passed|failed|Timeout" "$W/gpu_suite.log" | head -40
long() {  # name, then env assignments (FMT: the cache format, fp8 by default)
  local name=$1 t=$2; shift 2
  local s; s=$(date +%s)
  env "$@" timeout $t python3 bench/bench_engine.py --kv-format ${FMT:-fp8} --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$? ($(( $(date +%s) - s )) s)"; grep -E "kvplan \(|decode step" "$W/$name.log"; tar czf "$O/logs.tgz" -C "$W" .
}
long long_fp8_fused 100 KVPLAN_DECODE_FUSED_COMBINE=1
long long_fp8_default 60 KVPLAN_DECODE_FUSED_COMBINE=0
