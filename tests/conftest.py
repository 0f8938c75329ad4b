"""Shared test setup: the Triton interpreter on CPU-only machines and the ``gpu`` marker."""

import os

import torch

# One intra-op thread per test process: the suite runs under pytest-xdist with one worker per
# core, and small-model tests are far faster without thread hand-offs.
torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is created (at import of kvplan.ops.*).
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    # kvplan.ops does this on import; tests that jit kernels of their own may come first
    from kvplan.ops._interpreter_bf16 import install
    from kvplan.ops._interpreter_speed import install as install_speed

    install()  # the interpreter's tl.dot multiplies bf16 bits as integers otherwise
    install_speed()  # jit helpers called inside a kernel skip re-patching the language

import pytest  # noqa: E402

if os.environ.get("KVPLAN_RECORD_KERNELS"):  # see tests/kernel_record.py
    import tests.kernel_record  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
