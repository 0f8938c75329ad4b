"""``kvplan.ops._launch``: kvplan's kernels relaunched through their compiled launcher.

On CUDA: every argument change Triton specializes on (an int equal to 1 or a multiple of 16,
a pointer's 16-byte alignment, a dtype, a constexpr, a launch option) reaches a kernel compiled
for it, the results equal torch's for every launch, repeated launches take the lean path, a
launch hook or ``LEAN = False`` sends launches through Triton's path, a changed global raises
as Triton does, and lean launches replay in a CUDA graph. On the CPU: ``jit`` is Triton's
interpreter object."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kvplan.ops import _launch
from kvplan.ops._launch import LeanJITFunction, jit

_OFFSET = tl.constexpr(0.5)


@jit
def _affine_kernel(x_ptr, out_ptr, n, stride, scale, TILE: tl.constexpr, SHIFT: tl.constexpr):
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    x = tl.load(x_ptr + i * stride, mask=i < n, other=0.0).to(tl.float32)
    y = x * scale
    if SHIFT:
        y = y + _OFFSET
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=i < n)


def _run(x, n, stride, scale=2.0, tile=64, shift=True, out_dtype=torch.float32, **kw):
    out = torch.empty(n, dtype=out_dtype, device=x.device)
    _affine_kernel[(triton.cdiv(n, tile),)](x, out, n, stride, scale, TILE=tile, SHIFT=shift,
                                            **kw)  # fmt: skip
    want = x[: (n - 1) * stride + 1 : stride].float() * scale + (0.5 if shift else 0.0)
    return out, want.to(out_dtype)


def test_jit_is_the_interpreter_object_without_a_gpu():
    if torch.cuda.is_available():
        assert isinstance(_affine_kernel, LeanJITFunction)
    else:
        assert not isinstance(_affine_kernel, LeanJITFunction)
        x = torch.arange(40, dtype=torch.float32)
        out, want = _run(x, 40, 1)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


gpu = pytest.mark.gpu


@gpu
def test_every_specialization_runs_its_own_kernel():
    dev = torch.device("cuda")
    base = torch.randn(4096, device=dev)
    cases = [  # (x, n, stride, kwargs): each differs from the one before in one respect
        (base, 100, 1, {}),
        (base, 100, 2, {}),  # stride no longer == 1
        (base, 100, 16, {}),  # stride divisible by 16
        (base, 96, 16, {}),  # n divisible by 16
        (base[1:], 96, 16, {}),  # a pointer off the 16-byte alignment
        (base.to(torch.bfloat16), 96, 16, {}),  # another dtype
        (base, 96, 16, {"shift": False}),  # a constexpr
        (base, 96, 16, {"tile": 32}),  # a constexpr tile
        (base, 96, 16, {"num_warps": 2}),  # a launch option
        (base, 96, 16, {"out_dtype": torch.bfloat16}),
        (base, 1, 1, {}),  # n == 1
    ]
    before = _affine_kernel.lean_launches
    for _ in range(3):  # first pass compiles; the next two relaunch lean
        for x, n, stride, kw in cases:
            out, want = _run(x, n, stride, **kw)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert _affine_kernel.lean_launches - before == 2 * len(cases)


@gpu
def test_hooks_and_the_switch_take_tritons_path(monkeypatch):
    x = torch.randn(256, device="cuda")
    _run(x, 200, 1)
    before = _affine_kernel.lean_launches
    seen = []
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        out, want = _run(x, 200, 1)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(seen) == 1 and _affine_kernel.lean_launches == before
    monkeypatch.setattr(_launch, "LEAN", False)
    out, want = _run(x, 200, 1)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert _affine_kernel.lean_launches == before
    monkeypatch.setattr(_launch, "LEAN", True)
    _run(x, 200, 1)
    assert _affine_kernel.lean_launches == before + 1


@gpu
def test_a_changed_global_raises_as_triton_does(monkeypatch):
    x = torch.randn(64, device="cuda")
    _run(x, 64, 1)
    _run(x, 64, 1)
    monkeypatch.setitem(_affine_kernel.fn.__globals__, "_OFFSET", tl.constexpr(0.25))
    with pytest.raises(RuntimeError, match="Global variable _OFFSET has changed"):
        _run(x, 64, 1)


@gpu
def test_lean_launches_replay_in_a_cuda_graph():
    x = torch.randn(512, device="cuda")
    out = torch.empty(500, device="cuda")

    def launch():
        _affine_kernel[(8,)](x, out, 500, 1, 2.0, TILE=64, SHIFT=True)

    launch()  # compile, then one lean launch before capturing
    launch()
    torch.cuda.synchronize()
    before = _affine_kernel.lean_launches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    assert _affine_kernel.lean_launches == before + 1
    x.copy_(torch.randn(512, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x[:500] * 2.0 + 0.5, rtol=0, atol=0)


_SIZES_PROBE = r"""
from kvplan.backends.staging._expand_kernel import expand_step_kernel
from kvplan.ops.swa_index import _expand_swa_index_kernel


def unspecialized(kernel):
    if hasattr(kernel, "params"):  # a JITFunction
        return sorted(p.name for p in kernel.params if p.do_not_specialize)
    return sorted(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter's


print(unspecialized(_expand_swa_index_kernel), len(unspecialized(expand_step_kernel)))
"""


@pytest.mark.parametrize("switch", ["0", "1"])
def test_size_arguments_and_the_ab_switch(switch):
    """``jit(sizes=...)``: those arguments are not specialized, unless
    ``KVPLAN_SPECIALIZE_SIZES=1``; a kernel's own ``do_not_specialize`` (the staging kernel,
    relaunched with any ints by its hand-bound launcher) stays either way."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KVPLAN_SPECIALIZE_SIZES": switch, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _SIZES_PROBE], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()  # fmt: skip
    assert out[0] == ("['rows']" if switch == "0" else "[]")
    assert int(out[1]) == 13


def test_an_unknown_size_argument_is_an_error():
    def kernel(x_ptr, n, TILE: tl.constexpr):
        pass

    with pytest.raises(ValueError, match="kernel has no argument 'rows'"):
        jit(sizes=("n", "rows"))(kernel)
