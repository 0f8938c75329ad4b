#!/usr/bin/env bash
# Session 19, call D: ncu's stall reasons for bf16 vs fp8 decode (32 x 8K); tiling x split
# sweeps of the quantized decode (fp8's 239 registers allow 4 programs = 8 warps an SM, and
# the default 2 splits give ~3.9 programs an SM: ncu, call C); then the long fp8 engine with
# the fastest fp8 launch of the sweep against the default, side by side.
set -u
BUDGET=${BUDGET:-260}
source bench/gpu_steps.sh
step 70 sweep8k_fp8 python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats fp8 --graph --splits "" --tiles 32,64 --warps 2,4 --stages 2,3 --with-splits 2,4,8 --out "$W/sweep8k_fp8.json"
sed -n '/^format/,$p' "$W/sweep8k_fp8.log"
best=$(python3 -c "
import json; rows=[r for r in json.load(open('$W/sweep8k_fp8.json'))['rows'] if 'us' in r and isinstance(r['config'], dict)]
c=min(rows, key=lambda r: r['us'])['config']; print(c['tile_n'], c['num_warps'], c['num_stages'], c['num_splits'])" 2>/dev/null)
echo "fastest fp8 launch at 32 x 8K: $best"
if [ -n "$best" ]; then
  set -- $best
  step 75 long_fp8_best env KVPLAN_DECODE_TILING=$1,$2,$3 KVPLAN_DECODE_SPLITS=$4 python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_best.json"
  grep -E "kvplan \(|decode step" "$W/long_fp8_best.log"
  step 75 long_fp8_dflt python3 bench/bench_engine.py --kv-format fp8 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp8_dflt.json"
  grep -E "kvplan \(|decode step" "$W/long_fp8_dflt.log"
fi
step 35 ncu_stalls ncu --clock-control none -k regex:_decode_kernel --launch-skip 0 --launch-count 4 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --page raw --csv python3 bench/ncu_decode.py --formats bf16,fp8
python3 - "$W/ncu_stalls.log" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, data = rows[0], rows[2:]
for r in data[1::2]:
    vals = sorted(((float(v), h) for h, v in zip(head, r) if "stalled" in h and v.replace(".", "", 1).isdigit()), reverse=True)
    print(r[head.index("Block Size")], [(h.split("stalled_")[1].split("_per")[0], round(v, 2)) for v, h in vals[:8]])
PY
