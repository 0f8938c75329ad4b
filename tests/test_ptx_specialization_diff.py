"""``tools/ptx_specialization_diff.py`` on a recorded launch: the window-index expansion of
``expand_swa_index`` (its row count unspecialized) compiles for sm_90 both ways and the tool
reports the two PTX forms."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RECORD = r"""
import sys, torch
from tests.kernel_record import install
install(sys.argv[1])
from kvplan.ops.swa_index import expand_swa_index_triton
piv = torch.tensor([[0, 3, 100, 2], [50, 5, 7, 1], [9, 8, 0, 0]], dtype=torch.int32)
expand_swa_index_triton(piv, 8)
"""


def test_the_tool_compiles_both_forms_of_a_recorded_launch(tmp_path):
    record = tmp_path / "k.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    env.pop("KVPLAN_RECORD_KERNELS", None)
    subprocess.run([sys.executable, "-c", _RECORD, str(record)], cwd=ROOT, env=env, check=True,
                   timeout=120)  # fmt: skip
    assert "_expand_swa_index_kernel" in record.read_text()
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run([sys.executable, "tools/ptx_specialization_diff.py", str(record)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    if "ptxas" in proc.stderr and proc.returncode:  # no CUDA toolchain in this Triton install
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if "_expand_swa_index_kernel" in x)
    assert "unspecialized" in line and "sizes % 16 == 0" in line
    assert proc.stdout.strip().splitlines()[-1].startswith("1 specializations")
