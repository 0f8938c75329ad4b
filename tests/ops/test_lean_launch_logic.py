"""``LeanJITFunction``'s cache logic on the CPU (CI has no GPU): Triton's binder for an sm_90
target, a stand-in for Triton's launch path and for the compiled launcher. The lean path must
relaunch exactly the specializations Triton's path already compiled, with the arguments bound
in the kernel's order, and leave everything else to Triton's path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from kvplan.ops import _launch
from kvplan.ops._launch import LeanJITFunction

_GLOBAL = tl.constexpr(3)


def _kernel(x_ptr, out_ptr, n, stride, scale, TILE: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _Launcher:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, calls):
        self.calls = calls

    def launch(self, *args):
        self.calls.append(args)


@pytest.fixture
def lean(monkeypatch):
    """(kernel, Triton-path calls, C-launch calls) with device 0 and stream 77."""
    kernel = LeanJITFunction(_kernel)
    binder = create_function_from_signature(kernel.signature, kernel.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))  # fmt: skip
    kernel.device_caches[0] = ({}, {}, None, None, binder)
    slow, fast = [], []

    def triton_path(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return SimpleNamespace(run=_Launcher(fast), function=f"f{len(slow)}",
                               packed_metadata=("meta", len(slow)))  # fmt: skip

    kernel.run = triton_path
    monkeypatch.setattr(_launch, "LEAN", True)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 77)
    return kernel, slow, fast


def test_a_repeat_goes_to_the_compiled_launcher_with_bound_arguments(lean):
    kernel, slow, fast = lean
    x, out = torch.zeros(64), torch.zeros(64)
    first = kernel[(4,)](x, out, 64, 3, 0.5, TILE=16)
    assert len(slow) == 1 and not fast
    again = kernel[(4, 2)](x, out, 64, 3, 0.5, TILE=16)
    assert again is first and len(slow) == 1 and kernel.lean_launches == 1
    (call,) = fast
    assert call[:10] == (4, 2, 1, 77, "f1", False, False, None, None, ("meta", 1))
    assert call[10:13] == (None, None, None)  # launch metadata and hooks
    assert call[13:] == (x, out, 64, 3, 0.5, 16, False)  # every parameter, default included


@pytest.mark.parametrize(
    ("change", "new_compile"),
    [
        ({"n": 64}, False),  # same class (% 16) as the first call's 32
        ({"n": 33}, True),  # not divisible by 16 any more
        ({"n": 1}, True),  # == 1 is a constant
        ({"stride": 5}, False),  # 3 and 5: neither 1 nor % 16
        ({"stride": 16}, True),
        ({"scale": 2.5}, False),  # floats do not specialize
        ({"x": torch.zeros(64)[1:]}, True),  # a pointer off 16-byte alignment
        ({"x": torch.zeros(64, dtype=torch.bfloat16)}, True),
        ({"TILE": 32}, True),
        ({"FLAG": True}, True),
        ({"num_warps": 2}, True),
    ],
)
def test_only_what_triton_compiled_alike_is_relaunched(lean, change, new_compile):
    kernel, slow, fast = lean
    base = {"x": torch.zeros(64), "out": torch.zeros(64), "n": 32, "stride": 3, "scale": 0.5,
            "TILE": 16}  # fmt: skip

    def launch(a):
        kw = {k: v for k, v in a.items() if k in ("TILE", "FLAG", "num_warps")}
        kernel[(1,)](a["x"], a["out"], a["n"], a["stride"], a["scale"], **kw)

    launch(base)
    launch({**base, **change})
    assert len(slow) == (2 if new_compile else 1)
    assert len(fast) == (0 if new_compile else 1)
    launch({**base, **change})  # now cached either way
    assert len(slow) == (2 if new_compile else 1) and len(fast) == (1 if new_compile else 2)


def test_hooks_the_switch_and_changed_globals_take_tritons_path(lean, monkeypatch):
    kernel, slow, fast = lean
    x = torch.zeros(16)
    kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)
    hook = lambda *a: None  # noqa: E731
    _launch._knobs.runtime.launch_enter_hook.add(hook)
    try:
        kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)
    finally:
        _launch._knobs.runtime.launch_enter_hook.remove(hook)
    assert len(slow) == 2 and not fast
    monkeypatch.setattr(_launch, "LEAN", False)
    kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)
    assert len(slow) == 3 and not fast
    monkeypatch.setattr(_launch, "LEAN", True)
    kernel.used_global_vals[("_GLOBAL", 0)] = (_GLOBAL, globals())
    kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)
    assert len(slow) == 3 and len(fast) == 1
    monkeypatch.setitem(globals(), "_GLOBAL", tl.constexpr(4))
    kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)  # Triton's path (which raises on a GPU)
    assert len(slow) == 4 and len(fast) == 1


def test_a_kernel_with_scratch_memory_always_takes_tritons_path(lean):
    kernel, slow, fast = lean
    inner = kernel.run

    def with_scratch(*args, **kwargs):
        k = inner(*args, **kwargs)
        k.run.global_scratch_size = 256
        return k

    kernel.run = with_scratch
    x = torch.zeros(16)
    for _ in range(3):
        kernel[(1,)](x, x, 16, 1, 1.0, TILE=16)
    assert len(slow) == 3 and not fast
