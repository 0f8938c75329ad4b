"""The programmatic-dependent-launch switch (`kvplan.ops._triton_util`): parsing with a clear
error, off under the interpreter, launch options only for CUDA tensors; the kernels that wait
compile for sm_90 with and without the wait."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvplan.ops import _triton_util as tu


def test_pdl_mode_parsing(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for text, mode in (("", 0), ("0", 0), ("1", 1), ("2", 2)):
        monkeypatch.setenv("KVPLAN_PDL", text)
        assert tu._pdl_mode() == mode
    monkeypatch.setenv("KVPLAN_PDL", "3")
    with pytest.raises(ValueError, match="KVPLAN_PDL must be 0, 1 or 2, got '3'"):
        tu._pdl_mode()
    monkeypatch.setenv("KVPLAN_PDL", "2")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tu._pdl_mode() == 0  # the interpreter has no grid dependency control


def test_pdl_launch_options(monkeypatch) -> None:
    monkeypatch.setattr(tu, "PDL_MODE", 0)
    assert tu.pdl_launch(torch.zeros(1)) == {}
    monkeypatch.setattr(tu, "PDL_MODE", 1)
    assert tu.pdl_launch(torch.zeros(1)) == {}  # CPU tensors: nothing to launch with
    if torch.cuda.is_available():
        want = torch.cuda.get_device_capability()[0] >= 9
        assert tu.pdl_launch(torch.zeros(1, device="cuda")) == {"launch_pdl": want}


@pytest.mark.parametrize("mode", ["0", "2"])
def test_waiting_kernels_compile_for_sm90(mode) -> None:
    """With the switch on, the decode kernel's sm_90 code holds the grid-dependency wait;
    off, it holds none (a fresh process: the mode is read at import)."""
    code = (
        "import sys; sys.path[:0] = ['bench', '.']\n"
        "import decode_kernel_regs as d\n"
        "ck = d._launch('fp8+ra', 64, 2, 3)\n"
        "print('griddepcontrol.wait' in ck.asm['ptx'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVPLAN_PDL"] = mode
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == ("True" if mode == "2" else "False")
