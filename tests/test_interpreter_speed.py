"""`kvplan.ops._interpreter_speed`: jit helpers called inside an interpreted launch skip
Triton's re-patching of the language modules, and compute what they computed before."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only"
)


@triton.jit
def _scaled_row(x_ptr, row, cols, scale):
    v = tl.load(x_ptr + row * 16 + cols)
    return tl.sum(v * scale, axis=0)  # tl.sum: Triton's own jit helper (it sees tl.core)


@triton.jit
def _twice(v):
    return _inner(v) + _inner(v)  # a helper calling a helper


@triton.jit
def _inner(v):
    return tl.maximum(v, 0.0)


@triton.jit
def _rows_kernel(x_ptr, out_ptr, scale):
    row = tl.program_id(0)
    cols = tl.arange(0, 16)
    total = _scaled_row(x_ptr, row, cols, scale)
    tl.store(out_ptr + row, _twice(total))


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0])
    _rows_kernel[(x.shape[0],)](x, out, 0.5)
    return out


def test_nested_helpers_skip_the_patching_and_keep_the_values(monkeypatch):
    from triton.runtime import interpreter

    from kvplan.ops import _interpreter_speed

    _interpreter_speed.install()  # idempotent (conftest installed it)
    assert getattr(interpreter.InterpretedFunction.__call__, "skips_nested_patching", False)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    want = 2 * torch.clamp((x * 0.5).sum(1), min=0)
    patches = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn) or real(fn))
    got = _run(x)
    torch.testing.assert_close(got, want)
    # per launch: its own patching, then once for the first helper seeing tl.core (tl.sum);
    # without the skip every helper call of every program patched again (5 x 4 calls)
    assert len(patches) <= 2, [getattr(f, "__name__", f) for f in patches]
    # outside a launch the language is restored: the builtins are Triton's again
    assert tl.core.is_builtin(tl.load)


def test_the_values_equal_triton_s_own_path(monkeypatch):
    from triton.runtime import interpreter

    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    fast = _run(x)
    plain = interpreter.InterpretedFunction.__call__.__wrapped__
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", plain)
    assert torch.equal(_run(x), fast)
