#!/usr/bin/env bash
# Prepared in session 22 (no device time left) for the next session's first call: fp4 decode.
# Session 22 measured fp4 at 188.8 us a layer (32 x 8K) against fp8's 134.6 and built, untimed:
# - fp16 tiles for fp4 pages (KVPLAN_FP4_F16 / FP4_F16_TILES, off): sm_90 main loop 1,026
#   instructions at 128 registers in mode 2 (8 programs an SM), against 1,579 at 244 in the
#   default mode 1 and 1,437 at 168 in mode 2 with bf16 tiles.
# - fp16 tiles for the hybrid sparse attention over fp4 records (KVPLAN_SPARSE_FP4_F16,
#   off): split kernel 2,042 instructions at 222 registers against 3,398 at 255.
# - the caller-owned merge counters of the hybrid family (the GPU hybrid tests cover them).
# In order:
# 1. GPU tests of the paged kernels (the fp16 tiles' bit-exactness test included), the sparse
#    split path and the DeepSeek-V4 engine; the paged ones again with KVPLAN_FP4_F16=1.
# 2. fp4 per call, 32 x 8K: modes 1 / 2 x bf16 / fp16 tiles x 2 / 3 / 4 splits.
# 3. bf16 (164 registers: 6 an SM) at 3 splits vs its default 2.
# 4. The long workload: fp4 with KVPLAN_FP4_F16=0 / 1, fp8 beside them.
# 5. Hybrid decode with fp4 records, bf16 vs fp16 tiles (if the budget allows).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 150 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf --durations=15 tests/ops/test_paged_attention.py tests/ops/test_paged_attention_quantized.py tests/ops/test_sparse_split.py tests/engine/test_deepseek_v4_engine.py tests/backends
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
KVPLAN_FP4_F16=1 KVPLAN_SPARSE_FP4_F16=1 step 90 gpu_tests_f16 python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py tests/ops/test_sparse_split.py tests/engine/test_deepseek_v4_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests_f16.log" | head -20
step 70 fp4_b32 python3 bench/bench_quant_decode.py --graph --formats fp4 --no-tiling --prefetch 1,2 --fp4-f16 --with-splits 2,3,4 --splits "" --out "$W/fp4_b32.json"
grep -E "^  " "$W/fp4_b32.log"
step 30 bf16_b32 python3 bench/bench_quant_decode.py --graph --formats bf16 --no-tiling --with-splits 2,3 --splits "" --out "$W/bf16_b32.json"
grep -E "^  " "$W/bf16_b32.log"
long() {  # name, format, then env assignments
  local name=$1 fmt=$2; shift 2
  env "$@" timeout 55 python3 bench/bench_engine.py --kv-format $fmt --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/$name.json" > "$W/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "kvplan \(|decode step" "$W/$name.log"; tar czf "$O/logs.tgz" -C "$W" .
}
long long_fp4 fp4 KVPLAN_FP4_F16=0
long long_fp4_f16 fp4 KVPLAN_FP4_F16=1
long long_fp8 fp8 KVPLAN_FP4_F16=0
# 5. If time is left: hybrid decode with fp4 records, bf16 tiles vs fp16 tiles
#    (KVPLAN_SPARSE_FP4_F16), fp8 beside them (batch 32).
for f in 0 1; do
  KVPLAN_SPARSE_FP4_F16=$f step 45 hybrid_fp4_f16$f python3 bench/bench_hybrid.py --contexts 32768,131072 --formats fp4$([ $f = 1 ] && echo ,fp8) --out "$W/hybrid_fp4_f16$f.json"
  grep -E "^ *(fp4|fp8) .*(graphs|async)|^ +async|bytes/token|max batch" "$W/hybrid_fp4_f16$f.log"
done
