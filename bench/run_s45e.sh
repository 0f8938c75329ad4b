#!/usr/bin/env bash
# Session 45, call E2: KV quantization quality on the GPU with the real SmolLM2 weights. The
# packaged GGUF (98 MB) is over one call's 64 MiB, so call E1 carried its first half (and the
# gguf wheel) into /tmp/qw on the same warm machine; this call carries the second half, joins
# them, converts the GGUF once and runs bench/kv_quality.py on CUDA (bf16 model, bf16 KV as the
# reference), 64- and 16-token chunks.
set -u
O=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
test -f /tmp/qw/part1 || { echo "part1 missing: the machine of call E1 was not kept"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/qw/gguf-*.whl \
  || exit 4
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
cat /tmp/qw/part1 .qw2/part2 > /tmp/qw/smol.gguf
sha256sum /tmp/qw/smol.gguf | cut -c1-16  # b179c9523d0e6a0f here
python3 -c "from pathlib import Path; from kvplan.models.loader import convert_gguf_to_folder as c
c(Path('/tmp/qw/smol.gguf'), Path('/tmp/qw/smol'))" || exit 5
timeout 330 python3 bench/kv_quality.py --device cuda --model /tmp/qw/smol --variants real:fp8 \
  real:fp8-w64 real:fp8-w128 real:int8 real:int8-w64 real:fp4 real:fp4-w64 --out "$O/q64.json" \
  > "$O/q64.log" 2>&1
tail -14 "$O/q64.log"
timeout 150 python3 bench/kv_quality.py --device cuda --model /tmp/qw/smol --chunk 16 \
  --variants real:fp8 real:fp8-w16 real:fp8-w64 --out "$O/q16.json" > "$O/q16.log" 2>&1
tail -9 "$O/q16.log"
