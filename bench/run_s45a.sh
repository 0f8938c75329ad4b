#!/usr/bin/env bash
# Session 45, call A: weights asked into L2 ahead of the narrow decode GEMMs
# (`kvplan.ops.l2_prefetch`, KVPLAN_L2_PREFETCH): the GPU tests, the GEMMs alone
# (bench_l2_prefetch.py), the dense decode graph profiled off / o / o,qkv (inline and on a side
# stream), the short workload off vs on, and the hybrid 32K x 32 decode step off vs o.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests l2 60 4 tests/ops/test_l2_prefetch.py tests/models/test_l2_prefetch_models.py
step 60 gemms python3 bench/bench_l2_prefetch.py --out "$W/gemms.json"
cat "$W/gemms.log"
for v in 0 o o,qkv o,stream o,qkv,stream; do
  n=p_${v//,/_}
  step 45 "$n" env KVPLAN_L2_PREFETCH=$v python3 bench/profile_engine.py --replays 10 --steps 5 \
    --out "$W/$n"
  echo "== $v"; grep -E "kernel time per step|replay wall" "$W/$n.log"
done
short_run s_off bf16 KVPLAN_L2_PREFETCH=0
short_run s_o bf16 KVPLAN_L2_PREFETCH=o,qkv
short_run s_off2 bf16 KVPLAN_L2_PREFETCH=0
short_run s_o2 bf16 KVPLAN_L2_PREFETCH=o,qkv
hybrid_decode h_off 32 32768 KVPLAN_L2_PREFETCH=0
hybrid_decode h_o 32 32768 KVPLAN_L2_PREFETCH=o
hybrid_decode h_os 32 32768 KVPLAN_L2_PREFETCH=o,stream
