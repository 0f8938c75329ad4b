#!/usr/bin/env bash
# Session 52, call B: the whole GPU suite at the session's code (o_b_proj split in 2 by
# default, the greedy argmax in the decode graphs); the hybrid bench now takes the graph's
# tokens as the engine does: the 32K x 32 fp8 step with KVPLAN_GRAPH_ARGMAX 1 / 0 alternating
# (one pair before the suite, more after it if time is left), and one profile.
set -u
BUDGET=${BUDGET:-500}
source bench/gpu_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$W/gpu.txt"
for v in 1 0; do hybrid_decode ga${v}a 32 32768 KVPLAN_GRAPH_ARGMAX=$v; done
if [ "$BUDGET" -ge 420 ]; then set -- tests
elif [ "$BUDGET" -lt 300 ]; then  # little time: the files of this session's GPU tests
  set -- tests/engine/test_cuda_graphs.py tests/engine/test_hybrid_graphs.py \
    tests/engine/test_deepseek_v4_engine.py tests/engine/test_async_scheduling.py \
    tests/models/test_deepseek_v4_blocks.py tests/models/test_lm_head_argmax.py \
    tests/ops/test_hyper_connection_split.py tests/ops/test_small_gemm_argmax.py
else  # less time: what this session changed
  set -- tests/engine tests/models tests/ops/test_hyper_connection_split.py \
    tests/ops/test_hyper_connection_fused.py tests/ops/test_small_gemm_argmax.py \
    tests/ops/test_small_gemm.py tests/ops/test_argmax.py tests/bench
fi
gpu_tests suite $(( $(left) - 45 )) 14 "$@"
grep -E "^FAILED|^ERROR" "$W/suite.log" | head -20
for v in 1 0; do hybrid_decode ga${v}b 32 32768 KVPLAN_GRAPH_ARGMAX=$v; done
profile_32k p "nvjet_sm90_tss|hc_proj|argmax|small_linear|Memset"
