#!/usr/bin/env bash
# Session 35, call C: the dense engine's issue-17 workloads on the H100 this session got
# (the H200 figures are sessions 26-33's): the short workload against HF's best setting, the
# decode graph's kernels at batch 64, the long workload per KV format.
set -u
BUDGET=${BUDGET:-420}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
step 110 short_hf python3 bench/bench_engine.py --kv-format bf16 --hf generate_batch_cuda_graph \
  --out "$W/short_hf.json"
grep -E "kvplan \(|HF|decode step|x HF|floor" "$W/short_hf.log" | head -12
step 60 dense_prof python3 bench/profile_engine.py --kv-format bf16 --out "$W/dense_prof"
tail -25 "$W/dense_prof.log"
for f in fp8 bf16 fp4; do long_run long_$f $f; done
