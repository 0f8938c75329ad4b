#!/usr/bin/env bash
# Session 49, call A: session 48's calls C and D, which never ran, in one device call.
# C (bench/run_s48c.sh): one bf16 decode tiling, (64 keys, 4 warps, 3 stages), for every
# context, against the default, kernel alone and in both workloads. D (bench/run_s48d.sh): the
# long workload with 10 GiB of KV, where bf16 holds all 32 sequences, bf16 then fp8.
# Each writes its own logs.tgz under $OUT/c and $OUT/d.
set -u
base=${OUT:-/tmp/out}
OUT=$base/c BUDGET=290 bash bench/run_s48c.sh
OUT=$base/d BUDGET=135 bash bench/run_s48d.sh
