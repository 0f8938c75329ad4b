#!/usr/bin/env bash
# Session 45, call B: the L2 prefetch spread over many small programs (call A's one program a
# weight waited ~40 us for its bytes): the GEMMs alone by launch shape, the dense decode graph
# profiled off / o,stream / o,qkv,stream (two launch shapes), the short workload, and the
# hybrid 32K x 32 decode step off vs o,stream (after a warm-up run that compiles).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests l2 60 4 tests/ops/test_l2_prefetch.py tests/models/test_l2_prefetch_models.py
step 90 gemms python3 bench/bench_l2_prefetch.py --shapes 64,3072,2048,qkv 64,2048,2048,o \
  32,4096,2048,dsv4_4k --out "$W/gemms.json"
cat "$W/gemms.log"
prof() {  # NAME VAR=value...
  local n=$1; shift
  step 45 "$n" env "$@" python3 bench/profile_engine.py --replays 10 --steps 5 --out "$W/$n"
  echo "== $n $*"; grep -E "kernel time per step|replay wall|l2_prefetch|_decode_kernel|nvjet" "$W/$n.log" | head -9
}
prof p_off KVPLAN_L2_PREFETCH=0
prof p_os KVPLAN_L2_PREFETCH=o,stream
prof p_oqs KVPLAN_L2_PREFETCH=o,qkv,stream
prof p_oqs8k KVPLAN_L2_PREFETCH=o,qkv,stream KVPLAN_L2_PREFETCH_TILE=32,8192
prof p_oqi KVPLAN_L2_PREFETCH=o,qkv
short_run s_off bf16 KVPLAN_L2_PREFETCH=0
short_run s_on bf16 KVPLAN_L2_PREFETCH=o,qkv,stream
HD_SECS=90 hybrid_decode h_warm 32 32768 KVPLAN_L2_PREFETCH=0
hybrid_decode h_off 32 32768 KVPLAN_L2_PREFETCH=0
hybrid_decode h_os 32 32768 KVPLAN_L2_PREFETCH=o,stream
hybrid_decode h_off2 32 32768 KVPLAN_L2_PREFETCH=0
hybrid_decode h_os2 32 32768 KVPLAN_L2_PREFETCH=o,stream
