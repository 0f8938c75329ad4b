#!/usr/bin/env bash
# Session 19, call C: Nsight Compute on the dense decode kernel per KV format (32 x 8K, each
# format's default launch): what bounds fp8 at 1.9 TB/s where bf16 reaches 3.9 TB/s; and the
# split-count sweep of fp8 / int8 at that shape.
set -u
BUDGET=${BUDGET:-400}
source bench/gpu_steps.sh
step 60 time python3 bench/ncu_decode.py --time
cat "$W/time.log" | tail -5
step 200 ncu ncu --clock-control none -k regex:_decode_kernel --launch-skip 0 --launch-count 8 --set full -o "$W/decode" python3 bench/ncu_decode.py
tail -3 "$W/ncu.log"
step 60 ncu_details ncu --import "$W/decode.ncu-rep" --page details --print-units base
grep -E "^  _decode_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Stall|stall" "$W/ncu_details.log" | head -120
step 40 ncu_raw ncu --import "$W/decode.ncu-rep" --page raw --csv --metrics regex:smsp__average_warp_latency_issue_stalled_.*_per_issue_active.ratio
rm -f "$W/decode.ncu-rep.gz"; gzip -k "$W/decode.ncu-rep" 2>/dev/null; ls -la "$W" | head
step 60 splits python3 bench/bench_quant_decode.py --batch 32 --context 8192 --formats fp8,int8 --graph --no-tiling --splits 1,2,4,8 --out "$W/splits.json"
sed -n '/^format/,$p' "$W/splits.log"; grep -E "num_splits" "$W/splits.log" | head -12
tar czf "$O/logs.tgz" -C "$W" --exclude=decode.ncu-rep --exclude=decode.ncu-rep.gz .
cp "$W/decode.ncu-rep.gz" "$O/" 2>/dev/null || true
