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
