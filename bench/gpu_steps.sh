# Sourced by bench/run_s*.sh (one device call each): `step SECONDS NAME CMD...` runs CMD under
# a timeout of min(SECONDS, what is left of BUDGET), writing $W/NAME.log, and packs every log
# and JSON written so far into $OUT/logs.tgz (the device returns only a few files per call).
O=${OUT:-/tmp/out}
BUDGET=${BUDGET:-540}
W=$(mktemp -d)
mkdir -p "$O"
export PYTHONPATH=. PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
step() {
  local want=$1 name=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt 15 ]; then echo "$name: skipped (budget)"; return; fi
  [ "$want" -gt "$l" ] && want=$l
  timeout "$want" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$? ($(( $(date +%s) - start )) s)"
  tar czf "$O/logs.tgz" -C "$W" .
}
long_run() {  # NAME FORMAT [VAR=value ...]: the long workload (32 x 8,192 x 256) as one step
  local name=$1 fmt=$2; shift 2
  step "${LONG_SECS:-55}" "$name" env "$@" python3 bench/bench_engine.py --kv-format "$fmt" --num-requests 32 \
    --prompt-len 8192 --new-tokens 256 --hf "" --out "$W/$name.json"
  grep -E "kvplan \(|decode step" "$W/$name.log"
}
short_run() {  # NAME FORMAT [VAR=value ...]: the short workload (64 x 256 x 128) as one step,
  local name=$1 fmt=$2; shift 2  # the median of three timed runs (its prompt steps are noisy)
  step 40 "$name" env "$@" python3 bench/bench_engine.py --kv-format "$fmt" --hf "" \
    --repeats 3 --out "$W/$name.json"
  grep -E "kvplan \(|decode step" "$W/$name.log"
}
sparse_kernels() {  # NAME ROWS HCA_ENTRIES [VAR=value ...]: the sparse attention kernels
  local name=$1 rows=$2 hca=$3; shift 3  # alone (bench_sparse_kernels.py), one step
  step 70 "$name" env "$@" python3 bench/bench_sparse_kernels.py --only attention --no-chunked \
    --rows "$rows" --hca-entries "$hca" --out "$W/$name.json"
  grep -E "^sparse_attention" "$W/$name.log" | cut -c1-150
}
hybrid_ab() {  # VAR NAME: hybrid decode at 32K and 128K, batch 32, with VAR=0 (fp4 records)
  local f  # and VAR=1 (fp4 and fp8 records), one step each
  for f in 0 1; do
    step 50 "$2$f" env "$1=$f" python3 bench/bench_hybrid.py --contexts 32768,131072 \
      --formats fp4$([ "$f" = 1 ] && echo ,fp8) --out "$W/$2$f.json"
    grep -E "^ *(fp4|fp8) .*(graphs|async)|^ +async" "$W/$2$f.log"
  done
}
hybrid_decode() {  # NAME BATCH CONTEXT [VAR=value ...]: bench_hybrid's fp8 decode step, one step
  local name=$1 batch=$2 context=$3; shift 3  # of HD_SECS seconds (35; 128K x 256 needs ~80)
  step "${HD_SECS:-35}" "$name" env "$@" python3 bench/bench_hybrid.py --batch "$batch" \
    --contexts "$context" --formats fp8 --out "$W/$name.json"
  grep -E "^ *fp8 |async" "$W/$name.log"
}
gpu_tests() {  # NAME SECONDS WORKERS PATH...: `pytest -m gpu` of PATHs as one step, its tail shown
  local name=$1 secs=$2 workers=$3; shift 3
  step "$secs" "$name" python3 -m pytest -q -m gpu -n "$workers" -p no:cacheprovider --tb=short \
    -rf "$@"
  tail -3 "$W/$name.log"
}
decode_ab() {  # VAR NAME VALUE...: hybrid_decode at 32K x 32 with VAR at each VALUE, in order
  local var=$1 name=$2 v; shift 2
  for v in "$@"; do hybrid_decode "$name$v" 32 32768 "$var=$v"; done
}
profile_32k() {  # NAME PATTERN [VAR=value ...]: one profiled 32K x 32 fp8 step, its kernel
  local name=$1 pat=$2; shift 2  # lines matching PATTERN shown
  step 45 "$name" env "$@" python3 bench/bench_hybrid.py --batch 32 --contexts 32768 \
    --formats fp8 --profile 2 --out "$W/$name.json"
  grep -E "ALL KERNELS|async|$pat" "$W/$name.log"
}
