#!/usr/bin/env bash
# Session 9, last call: GPU tests of the merged kernel work (row-tiled hyper-connections,
# sparse attention register variants, quantized decode tiles, in-place / bf16 prefill rows),
# the kernel sweeps that set defaults, and the hybrid end to end with the fastest prompt tiling.
set -u
source bench/gpu_steps.sh
step 90 gpu_tests python3 -m pytest -v -m gpu -n 12 -p no:cacheprovider --tb=short -rf tests/ops/test_hyper_connection_rows.py tests/ops/test_sparse_tiling.py tests/ops/test_moe_grouped_plans.py tests/ops/test_paged_attention_quantized.py tests/ops/test_paged_decode_regs.py tests/backends/test_backends_triton.py tests/backends/test_hybrid_gpu_kernels.py tests/engine/test_deepseek_v4_engine.py tests/engine/test_quantized_kv_engine.py
grep -E "passed|failed|^FAILED" "$W/gpu_tests.log" | tail -8
step 75 sparse python3 bench/bench_sparse_kernels.py --only prefill --prefill-short --out "$W/sparse.json"
grep -E "FASTEST|MISMATCH" "$W/sparse.log"
TILING=$(python3 - "$W/sparse.json" <<'PY'
import ast, json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception:
    print("{}"); sys.exit()
ok = [r for r in rows if r["case"].startswith("sparse_attention prefill") and "speedup" in r
      and r.get("rel_err", 0) <= 2e-2]
best = max(ok, key=lambda r: r["speedup"], default=None)
cfg = {}
if best and best["path"].startswith("new {"):
    cfg = ast.literal_eval(best["path"][4:])
    cfg.pop("num_splits", None)
print(json.dumps(cfg))
PY
)
echo "prompt tiling for the end to end: $TILING"
step 140 hybrid_hf python3 bench/bench_hybrid_hf.py --split --profile-prefill --sparse-prompt-tiling "$TILING" --out "$W/hybrid_hf.json"
tail -3 "$W/hybrid_hf.log"
python3 -c "import json; d=json.load(open('$W/hybrid_hf.json')); [print(r.get('kv_format'), e['name'][:50], round(e['ms'],2), e['calls']) for r in d['runs'] if r.get('kv_format') for e in r['prefill_profile']['self_device_time_total'][:10]]"
step 35 moe python3 bench/bench_dsv4_blocks.py --moe-sweep --moe-rows 8192 --out "$W/moe.json"
tail -14 "$W/moe.log"
step 35 hc python3 bench/bench_dsv4_blocks.py --hc-rows 8192 --out "$W/hc.json"
grep -E "rows|faster|slower|equal" "$W/hc.log" | tail -8
step 45 quant_decode python3 bench/bench_quant_decode.py --formats bf16,fp8,fp4 --tiles 32,64 --warps 4 --stages 2,5 --out "$W/quant_decode.json"
tail -12 "$W/quant_decode.log"
