"""Lean launches of kvplan's Triton kernels: ``@jit`` (this module's) instead of ``@triton.jit``.

Triton's launch path (``kernel[grid](*args)``) does per call: the current device and stream,
the pre-run hooks, the binder (each argument's specialization: dtype, 16-byte alignment,
``== 1``), a cache key that formats the launch options as a string, the check of the globals
the kernel read, the launch metadata, then the compiled launcher's Python wrapper and its C
entry. Measured on the H200 (``bench/triton_launch_cost.py``): 29.3 us a call against 9.6 us
for the compiled launcher alone. An eager DeepSeek-V4 step launches ~290 Triton kernels.

``LeanJITFunction`` keeps the parts that decide WHICH compiled kernel runs -- the binder's
specialization of every argument, the keyword arguments (launch options and constexprs), the
debug / instrumentation knobs, the current device -- as its own cache key, and on a hit calls
the compiled launcher's C entry with the bound arguments, as ``CompiledKernel.run`` would.
The first launch of each key takes Triton's own path (it compiles, checks and launches), and
so does every launch while a launch hook (a profiler) or a pre-run hook is installed, a global
the kernel read has changed (Triton then raises), or the kernel needs scratch memory. A key is
at least as fine as Triton's own (the same specialization; options compared as values), so a
hit runs the kernel Triton's path would have chosen.

Sizes. Triton also compiles a kernel anew for every class of its int arguments: equal to 1,
divisible by 16, neither. Kernels name their step-size arguments (token / row / entry counts)
in ``jit(sizes=...)`` where the count only bounds a mask along a non-contiguous dimension,
counts a loop, or is compared with loaded values; those are not specialized, so a step of a
new size reuses the compiled kernel instead of compiling inside the step
(``bench/specializations.py`` counts the compiles; ``tools/ptx_specialization_diff.py``
compares the sm_90 code with the specialized one). Counts that bound contiguous loads
(``cols < num_cols``) keep specializing: their divisibility lets Triton vectorize.
``KVPLAN_SPECIALIZE_SIZES=1`` (read at import, for A/B runs) specializes them all again.

Under the interpreter (``TRITON_INTERPRET=1``) ``jit`` is ``triton.jit``.
``KVPLAN_LEAN_LAUNCH=0`` (read at import) or ``LEAN = False`` sends every launch Triton's way.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

LEAN = os.environ.get("KVPLAN_LEAN_LAUNCH", "1") != "0"
SPECIALIZE_SIZES = os.environ.get("KVPLAN_SPECIALIZE_SIZES", "0") == "1"

_knobs = triton.knobs
_MISSING = object()


# torch's current CUDA device / raw stream (what Triton's driver asks); absent without CUDA
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def direct_launch(kernel: Any) -> tuple | None:
    """``(launch, function, cooperative, pdl, packed_metadata)`` of a compiled kernel: the C
    entry of Triton 3.6's CUDA launcher and the values ``CompiledKernel.run`` passes it. None
    (keep Triton's path) when the kernel needs scratch memory or the launcher has another
    shape (another Triton version)."""
    try:
        launcher = kernel.run
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        return (launcher.launch, kernel.function, launcher.launch_cooperative_grid,
                launcher.launch_pdl, kernel.packed_metadata)  # fmt: skip
    except AttributeError:
        return None


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook (a profiler's) is installed; those launches must take
    Triton's path, which calls them."""
    runtime = _knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


class LeanJITFunction(JITFunction):
    """A ``JITFunction`` whose ``kernel[grid](...)`` relaunches compiled kernels through
    their C launcher (see the module docstring). ``lean_launches`` counts those launches."""

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self._lean: dict[tuple, tuple | None] = {}
        self.lean_launches = 0

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not LEAN or self.pre_run_hooks or launch_hooks_installed():
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        device = _current_device()
        # Triton's per-device caches and binder (built on this device's first launch)
        bound, specialization, _ = self.device_caches[device][4](*args, **kwargs)
        try:
            key = (device, tuple(specialization), tuple(kwargs.items()), _knobs.runtime.debug,
                   _knobs.compilation.instrumentation_mode)  # fmt: skip
            hit = self._lean.get(key, _MISSING)
        except TypeError:  # an unhashable keyword value: Triton's path
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        if hit is _MISSING:
            return self._first(key, grid, args, kwargs)
        if hit is None or (self.used_global_vals and self._globals_changed()):
            return self.run(*args, grid=grid, warmup=False, **kwargs)
        kernel, launch, function, coop, pdl, packed = hit
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
               _current_stream(device), function, coop, pdl, None, None, packed, None, None,
               None, *bound.values())  # fmt: skip
        self.lean_launches += 1
        return kernel

    def _first(self, key, grid, args, kwargs):
        """Triton's path (compiles if needed); remember the compiled kernel under ``key``."""
        kernel = self.run(*args, grid=grid, warmup=False, **kwargs)
        if kernel is None:
            return kernel
        direct = direct_launch(kernel)
        self._lean[key] = None if direct is None else (kernel, *direct)
        return kernel

    def _globals_changed(self) -> bool:
        for (name, _), (val, globals_dict) in self.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:
                return True
        return False


def jit(fn=None, *, sizes: tuple[str, ...] = (), **kwargs):
    """``triton.jit`` for kvplan's kernels: a ``LeanJITFunction`` when compiling for a GPU,
    Triton's own object under the interpreter. Takes ``triton.jit``'s keyword arguments, and
    ``sizes``: the arguments that change with the step's size and only bound masks or loops
    (not specialized; see "Sizes" above)."""

    def decorate(f):
        params = inspect.signature(f).parameters
        for name in sizes:  # Triton ignores unknown names: a typo would keep specializing
            if name not in params:
                raise ValueError(f"jit(sizes=...): {f.__name__} has no argument {name!r}")
        kw = dict(kwargs)
        if sizes and not SPECIALIZE_SIZES:
            kw["do_not_specialize"] = (*kw.get("do_not_specialize", ()), *sizes)
        if _knobs.runtime.interpret:
            return triton.jit(f, **kw)
        return LeanJITFunction(f, **kw)

    return decorate if fn is None else decorate(fn)
