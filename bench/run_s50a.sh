#!/usr/bin/env bash
# Session 50, call A: split-K qkv / o / down projections whose fp32 partials the kernel after
# each adds up (`KVPLAN_SPLIT_LINEAR`). The GEMM + consumer pairs alone
# (bench_split_linear.py); the short workload's decode graph profiled off and with splits;
# the workload end to end; then the GPU tests of the new path and of the paths changed since
# session 45.
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 90 split python3 bench/bench_split_linear.py --out "$W/split.json"
cat "$W/split.log"
prof() {  # NAME VAR=value...
  local n=$1; shift
  step 40 "$n" env "$@" python3 bench/profile_engine.py --replays 20 --steps 5 --out "$W/$n"
  echo "== $n $*"; grep -E "replay wall|kernel time|nvjet|splitK|bmm|gemm|rms_norm|elementwise|copy" \
    "$W/$n.log" | head -14
}
for s in 0 4 2 8; do prof p$s KVPLAN_SPLIT_LINEAR=$s; done
prof pod4 KVPLAN_SPLIT_LINEAR=o=4,down=4
prof pod2 KVPLAN_SPLIT_LINEAR=o=2,down=2
for s in 0 4 2; do short_run e$s bf16 KVPLAN_SPLIT_LINEAR=$s; done
gpu_tests changed 110 14 tests/models/test_split_linear.py tests/models/test_fused_gpu.py \
  tests/backends/test_fresh_prefill_gpu.py tests/engine/test_kv_exact_window.py \
  tests/ops/test_paged_attention_ring.py
