#!/usr/bin/env bash
# Session 45, call C: the short workload's decode attention inside the engine (cold L2: 21 us a
# layer against ~15 us for the kernel replayed alone) by split count and tiling
# (KVPLAN_DECODE_SPLITS / KVPLAN_DECODE_TILING), bf16 and fp8; the short workload end to end
# with 2 splits; fp8 with and without a 64-position exact window after session 44's last change.
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
prof() {  # NAME FORMAT VAR=value...
  local n=$1 f=$2; shift 2
  step 40 "$n" env "$@" python3 bench/profile_engine.py --kv-format "$f" --replays 20 --steps 5 \
    --out "$W/$n"
  echo "== $n $f $*"; grep -E "kernel time per step|replay wall|_decode_kernel|_combine" "$W/$n.log" | head -4
}
prof b_s1 bf16 KVPLAN_DECODE_SPLITS=1
prof b_s2 bf16 KVPLAN_DECODE_SPLITS=2
prof b_s3 bf16 KVPLAN_DECODE_SPLITS=3
prof b_s4 bf16 KVPLAN_DECODE_SPLITS=4
prof b_t32 bf16 KVPLAN_DECODE_TILING=32,2,3
prof b_t32s2 bf16 KVPLAN_DECODE_TILING=32,2,3 KVPLAN_DECODE_SPLITS=2
prof b_t64w4 bf16 KVPLAN_DECODE_TILING=64,4,3
prof f_s1 fp8 KVPLAN_DECODE_SPLITS=1
prof f_s2 fp8 KVPLAN_DECODE_SPLITS=2
prof f_s3 fp8 KVPLAN_DECODE_SPLITS=3
short_run e_s1 bf16 KVPLAN_DECODE_SPLITS=1
short_run e_s2 bf16 KVPLAN_DECODE_SPLITS=2
for w in 0 64; do
  step 40 "w$w" python3 bench/bench_engine.py --kv-format fp8 --kv-exact-window $w --hf "" \
    --out "$W/w$w.json"
  grep -E "kvplan \(|decode step" "$W/w$w.log"
done
