#!/usr/bin/env bash
# Session 20, call C: decode mode 2 is fp8's and int8's default (DECODE_PREFETCH), int8 at
# (64, 2, 3). GPU tests of the paged kernels and quantized engines; the fp8 / int8 tile sweep
# in mode 2 (32-, 64-, 128-key tiles); the long workload with bf16, fp8 and the short one with
# bf16 and fp8 side by side (issue 17: fp8 >= 1.3x bf16 long, >= 1.0x short).
set -u
BUDGET=${BUDGET:-540}
source bench/gpu_steps.sh
step 170 gpu_tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short -rf -k "quantiz or paged or fp8 or int8 or fp4 or kv_format" tests
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
step 130 sweep python3 bench/bench_quant_decode.py --graph --formats fp8,int8 --tiles 32,64,128 --warps 2,4 --stages 3 --prefetch 2 --splits "" --out "$W/sweep.json"
grep -E "^  (fp8|int8) " "$W/sweep.log"
for f in fp8 bf16; do
  step 60 long_$f python3 bench/bench_engine.py --kv-format $f --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_$f.json"
  grep -E "kvplan \(|decode step" "$W/long_$f.log"
done
for f in fp8 bf16; do
  step 50 short_$f python3 bench/bench_engine.py --kv-format $f --hf "" --out "$W/short_$f.json"
  grep -E "kvplan \(|decode step" "$W/short_$f.log"
done
