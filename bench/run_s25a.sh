#!/usr/bin/env bash
# Prepared in session 24 for the next session's first call (steps past the budget are
# skipped: run the rest in a second call).
# 1. GPU tests of decode mode 3 (commit 561be30, off by default: an fp8 / int8 K's logits by
#    scale group, fp16 MMAs of the codes as stored; sm_90 main loop 783 instructions at the
#    168-register cap, no spills, against 921 with 24 spill bytes in mode 2) and of the dense
#    decode's fused combine (KVPLAN_DECODE_FUSED_COMBINE=1, off by default).
# 2. One fp8 decode call at 32 x 8K: mode 2 (default) vs 3, caps 168 / none, 3 / 4 splits.
# 3. Long workload (32 x 8,192 x 256): fp8 by default, with mode 3, with the fused combine,
#    with both; int8 with mode 3. Short workload (64 x 256 x 128): fp8 with mode 3.
# 4. Where a long prefill's ~6-10 ms outside kernels go (`profile_prefill.py --host`, now
#    keeping the second profiled run).
# 6. (session 25, CPU only) the commits of a prefill step moved before its token wait and
#    cheaper block hashing (bench/host_prefill.py: 2.96 -> 0.97 ms of host work the device
#    waits for per 8,000-token prompt on a 2-core CPU): steps 3-4 measure it in the long
#    workload; the hybrid end to end below measures it on DeepSeek-V4's prefill.
# 5. bf16 / fp8 decode at the short workload's shape (64 x 320: 13-15 us a call against ~5 us
#    of bytes) with the larger tiles no sweep has tried there (128 / 256 keys, 4 / 8 warps).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 150 gpu_tests python3 -m pytest -q -m gpu -n 16 -p no:cacheprovider --tb=short -rf tests/ops/test_paged_attention_quantized.py tests/engine/test_quantized_kv_engine.py tests/ops/test_paged_attention.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -20
step 80 mode3_b32 python3 bench/bench_quant_decode.py --graph --formats fp8 --no-tiling --prefetch 3 --maxnreg 168 --with-splits 3,4 --splits "" --out "$W/mode3_b32.json"
grep -E "^  " "$W/mode3_b32.log"
long_run long_fp8 fp8
long_run long_fp8_m3 fp8 KVPLAN_DECODE_PREFETCH=3
long_run long_fp8_fc fp8 KVPLAN_DECODE_FUSED_COMBINE=1
long_run long_fp8_m3fc fp8 KVPLAN_DECODE_FUSED_COMBINE=1 KVPLAN_DECODE_PREFETCH=3
long_run long_int8_m3 int8 KVPLAN_DECODE_PREFETCH=3
step 40 short_fp8_m3 env KVPLAN_DECODE_PREFETCH=3 python3 bench/bench_engine.py --kv-format fp8 --hf "" --out "$W/short_fp8_m3.json"
grep -E "kvplan \(|decode step" "$W/short_fp8_m3.log"
step 80 prefill_host python3 bench/profile_prefill.py --variants bf16,fp8 --prompts 3 --top 25 --host --out "$W/prefill_host.json"
grep -vE "Warning|warn" "$W/prefill_host.log" | head -70
step 60 short_tiles python3 bench/bench_quant_decode.py --graph --batch 64 --context 320 --formats bf16,fp8 --tiles 128,256 --warps 4,8 --stages 2,3 --splits "" --out "$W/short_tiles.json"
grep -E "^  " "$W/short_tiles.log"
step 100 hybrid_e2e python3 bench/bench_hybrid_hf.py --split --no-hf --out "$W/hybrid_e2e.json"
grep -E "tok/s|prefill|decode step" "$W/hybrid_e2e.log" | head -12
