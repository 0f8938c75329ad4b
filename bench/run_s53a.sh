#!/usr/bin/env bash
# Session 53, call A: the whole GPU suite with session 52's defaults (o_b_proj in 2 split-K
# partials, the greedy argmax in the decode graphs), then the in-graph argmax A/B
# (KVPLAN_GRAPH_ARGMAX 0 / 1, alternating) on the 32K x 32 fp8 hybrid decode step and the
# dense short workload; a profiled 32K x 32 step with its kernel timeline.
set -u
BUDGET=${BUDGET:-565}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
git log --oneline -1 | tee "$W/commit.txt"
gpu_tests suite 280 14 tests
grep -E "^FAILED|^ERROR" "$W/suite.log" | head -20
for r in a b; do
  for v in 0 1; do hybrid_decode a$v$r 32 32768 KVPLAN_GRAPH_ARGMAX=$v; done
done
for r in a b; do
  for v in 0 1; do short_run g$v$r bf16 KVPLAN_GRAPH_ARGMAX=$v; done
done
# one profiled step with its kernel timeline (the JSON's "timeline": what runs next to the
# 12 Memsets, the gaps between launches)
profile_32k prof "Memset|nvjet|_topk|hc_"
