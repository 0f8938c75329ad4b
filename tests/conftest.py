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
    # its import installs the interpreter fixes (bf16 dots and casts, jit helpers that skip
    # re-patching the language); tests that jit kernels of their own may come first
    import kvplan.ops._dispatch  # noqa: F401

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
