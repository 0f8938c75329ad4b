#!/usr/bin/env bash
# Session 54, call D: the whole GPU suite with this session's defaults (the top-k's register
# forms on), then one profiled 32K x 32 fp8 step with the top-k forms off and one with them on
# (the top-k's share of the step's kernels, side by side on one machine).
set -u
BUDGET=${BUDGET:-520}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
gpu_tests suite 330 14 tests
grep -E "passed|failed" "$W/suite.log" | tail -2
profile_32k topk_off "_topk|index_scores|ALL" KVPLAN_TOPK_ROW_TAIL=0 KVPLAN_TOPK_REG_WRITE=0
profile_32k topk_on "_topk|index_scores|ALL"
