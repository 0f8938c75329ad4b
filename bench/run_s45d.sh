#!/usr/bin/env bash
# Session 45, call D: call C's one promising launch (bf16 decode tiling 64 keys, 4 warps, 3
# stages) against the default (64, 2, 5), alternating, profiled and end to end; then the whole
# GPU suite on this session's code (session 44's last commits had not run on a GPU).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
prof() {  # NAME VAR=value...
  local n=$1; shift
  step 40 "$n" env "$@" python3 bench/profile_engine.py --replays 20 --steps 5 --out "$W/$n"
  echo "== $n $*"; grep -E "replay wall|_decode_kernel" "$W/$n.log" | head -2
}
for i in 1 2; do
  prof d$i KVPLAN_DECODE_TILING=64,2,5
  prof t$i KVPLAN_DECODE_TILING=64,4,3
done
short_run e_d bf16 KVPLAN_DECODE_TILING=64,2,5
short_run e_t bf16 KVPLAN_DECODE_TILING=64,4,3
gpu_tests suite 340 14 tests
grep -E "passed|failed|error" "$W/suite.log" | tail -5
