#!/usr/bin/env bash
# Prepared at the end of session 13 (its device time spent): the GPU tests of its last top-k
# change (a part past a row's count skips its work), then the measurements its defaults still
# lack: the hc projection's tensor-core form at decode sizes (32 / 256 rows: today the IEEE
# form; 2.9-3.0x faster at 4,096-8,192 rows); the top-k plan's boundary (64 rows of 32,768
# columns: the plan takes the register row + parts up to 66 rows, the compacting search
# above); the split tiling on bf16 rows (measured on fp8 records only); the register-footprint
# variants at 256 rows (fp8 records, one program); the hybrid decode at batch 64 and 128K (the
# plan's boundary in the engine); the dense end to end against HF (issue 17's 30x, not
# re-measured since session 11).
set -u
BUDGET=${BUDGET:-560}
source bench/gpu_steps.sh
step 60 gpu_tests python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=short -rf tests/ops/test_topk.py tests/engine/test_deepseek_v4_engine.py
grep -E "passed|failed|^FAILED|^E " "$W/gpu_tests.log" | head -8
step 60 hc_forms python3 bench/bench_dsv4_blocks.py --hc-rows 32,256 --out "$W/hc_forms.json"
grep -E "hc_pre@|hc_post_pre@" "$W/hc_forms.log"
step 60 topk_mid python3 bench/bench_sparse_kernels.py --rows 64 --candidates 32768 --only topk --out "$W/topk64.json"
grep -E "FASTEST|old  " "$W/topk_mid.log"
step 60 attn32bf16 python3 bench/bench_sparse_kernels.py --only attention --attention-sweep stages --attention-format bf16 --out "$W/attn32bf16.json"
grep -E "FASTEST|old  |new  " "$W/attn32bf16.log" | tail -6
step 60 attn256chunked python3 bench/bench_sparse_kernels.py --rows 256 --only attention --hca-entries 1024 --out "$W/attn256chunked.json"
grep -E "FASTEST|old  |new  " "$W/attn256chunked.log" | tail -6
step 60 hybrid_mid python3 bench/bench_hybrid.py --contexts 131072 --batch 64 --formats fp8,exact --out "$W/hybrid_b64.json"
grep -E "131072|async" "$W/hybrid_mid.log"
step 150 dense_hf python3 bench/bench_engine.py --out "$W/dense_hf.json"
grep -E "tok/s|x HF" "$W/dense_hf.log" | tail -8
