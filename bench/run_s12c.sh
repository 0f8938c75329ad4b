#!/usr/bin/env bash
# Third call: where a 32K hybrid decode step's time goes now (kernel table), the end to end
# (fp8, no HF) at step budgets 8K (the default run) / 16K / 32K (fewer, larger prefill steps)
# and with the per-row indexer (the A/B of index_scores_by_sequence against the 8K run), and
# the hc projection's program target at 8,192 rows (never swept: 84 us a call against ~32 us
# of reads in the 07:15 profile), and the long fp4 workload if time remains.
set -u
source bench/gpu_steps.sh
step 70 hybrid_profile python3 bench/bench_hybrid.py --contexts 32768 --formats fp8 --profile 1 --out "$W/hybrid_profile.json"
grep -E "32768" "$W/hybrid_profile.log" | tail -3
for b in 8192 16384 32768; do
  step 90 e2e_$b python3 bench/bench_hybrid_hf.py --no-hf --kv-formats fp8 --split --max-num-batched-tokens $b --out "$W/e2e_$b.json"
  grep -E "tok/s" "$W/e2e_$b.log"
done
step 90 e2e_rowidx env KVPLAN_INDEX_BY_SEQUENCE=0 python3 bench/bench_hybrid_hf.py --no-hf --kv-formats fp8 --split --out "$W/e2e_rowidx.json"
grep -E "tok/s" "$W/e2e_rowidx.log"
step 60 hc_proj python3 bench/bench_dsv4_blocks.py --rows 8192 --proj-programs 256,512,1024,2048 --out "$W/hc_proj.json"
grep -E "projection target" "$W/hc_proj.log"
step 100 long_fp4 python3 bench/bench_engine.py --kv-format fp4 --num-requests 32 --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/long_fp4.json"
grep -E "kvplan \(|decode step|compiles" "$W/long_fp4.log"
