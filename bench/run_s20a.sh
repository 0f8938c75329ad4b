#!/usr/bin/env bash
# Prepared in session 19 for the next session's first call: the whole GPU suite (session 19
# changed fp4's decode tiling to (64, 2, 2), measured per call but not in the engine, and the
# split override KVPLAN_DECODE_SPLITS), then the long workload side by side with bf16, fp8 and
# fp4 pages (issue 17: fp4 >= fp8, fp8 >= 1.3x bf16).
set -u
BUDGET=${BUDGET:-585}
source bench/gpu_steps.sh
step 280 gpu_suite python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_suite.log" | head -20
for f in fp4 fp8 bf16; do
  step 80 long_$f python3 bench/bench_engine.py --kv-format $f --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_$f.json"
  grep -E "kvplan \(|decode step" "$W/long_$f.log"
done
