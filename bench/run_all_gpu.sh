#!/usr/bin/env bash
# Runs every GPU test and every benchmark on the GPU machine in one go (the device tool's one
# call): `bash bench/run_all_gpu.sh OUTDIR [bench ...]`. Each bench writes OUTDIR/<name>.json
# and OUTDIR/<name>.log; the GPU tests write OUTDIR/gpu_tests.log.
set -u
OUTDIR=${1:?usage: run_all_gpu.sh OUTDIR [bench ...]}
shift
mkdir -p "$OUTDIR"
export PYTHONPATH=. PYTHONUNBUFFERED=1
BENCHES=("$@")
if [ ${#BENCHES[@]} -eq 0 ]; then
    BENCHES=(tests store_load index_ops paged_attention plan plan_device prepare engine hybrid
             hybrid_hf sparse_kernels compress_store dsv4_blocks moe_grouped small_gemm)
fi
for b in "${BENCHES[@]}"; do
    start=$(date +%s)
    if [ "$b" = tests ]; then
        python3 -m pytest tests -q -m gpu -p no:cacheprovider >"$OUTDIR/gpu_tests.log" 2>&1
        echo "tests: rc=$? ($(tail -1 "$OUTDIR/gpu_tests.log")) $(( $(date +%s) - start ))s"
    else
        python3 "bench/bench_$b.py" --out "$OUTDIR/$b.json" >"$OUTDIR/$b.log" 2>&1
        echo "bench_$b: rc=$? $(( $(date +%s) - start ))s"
    fi
done
