#!/usr/bin/env bash
# Session 27, call B: why the hybrid workload did not finish with the prompt range path
# (call A: KVPLAN_PROMPT_RANGES=1 ran past 80 s, =0 took 40 s). A small run with a traceback
# dump after 45 s, then the DeepSeek-V4 engine's GPU tests on the range path.
set -u
BUDGET=${BUDGET:-300}
source bench/gpu_steps.sh
step 90 small env KVPLAN_PROMPT_RANGES=1 python3 -X faulthandler -c "
import faulthandler, sys, runpy
faulthandler.dump_traceback_later(45, exit=True)
sys.argv = ['bench_hybrid_hf.py', '--no-hf', '--kv-formats', 'fp8', '--num-requests', '2',
            '--prompt-len', '4096', '--new-tokens', '8']
runpy.run_path('bench/bench_hybrid_hf.py', run_name='__main__')
"
grep -vE "Writing model|^\s*$" "$W/small.log" | tail -60
step 150 dsv4_gpu python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider --tb=short -rf -x \
  tests/engine/test_deepseek_v4_engine.py tests/engine/test_hybrid_async.py tests/engine/test_hybrid_graphs.py
tail -30 "$W/dsv4_gpu.log"
