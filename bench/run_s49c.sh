#!/usr/bin/env bash
# Session 49, call C: the whole GPU suite at this session's code (last run whole in session
# 45: sessions 46-48 changed the fresh-prefill paths and the windowed prompts' `rows` mode),
# then the short bf16 workload twice more (issue 17's decode step against its floor).
set -u
BUDGET=${BUDGET:-470}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 370 14 tests
grep -E "passed|failed|error" "$W/suite.log" | tail -5
short_run s1 bf16
short_run s2 bf16
