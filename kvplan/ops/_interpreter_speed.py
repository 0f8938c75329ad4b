"""A faster Triton 3.6 CPU interpreter for nested ``@triton.jit`` calls (tests and ``--quick``).

Triton's interpreter patches the language modules visible from a kernel (``tl``, ``tl.core``:
every builtin wrapped for the interpreter's semantics, ``tl.range`` and friends replaced) when
a launch starts and restores them when it ends. A ``@triton.jit`` helper called from inside a
kernel is an ``InterpretedFunction`` too, and its ``__call__`` runs the same patching again,
for every call of every program of the grid: ``inspect.getmembers`` over the modules, ~250
builtins looked at each time, while the launch's own patches are already in place (the helper's
patches are never restored either; the launch's restore puts the originals back). Profiled on
the quick DeepSeek-V4 model's 8-token prompt step, that re-patching was most of the
interpreter's time (21,272 ``getmembers`` calls for 85 launches).

`install` wraps the launch (``GridExecutor.__call__``) to track the language modules patched
while it runs (its own; then those a helper's patching added), and a helper's ``__call__`` to
skip the re-patching when every language module the helper sees is among them. Otherwise (a
helper called outside a launch, or the first helper of a launch that sees a module the launch
did not patch, e.g. Triton's own ``tl.sum`` seeing ``tl.core``) Triton's own path runs, and
its modules count as patched for the rest of the launch (nothing restores them before the
launch ends). The record is kept per thread (a helper of one thread never counts on another
thread's launch). The kernel code, its arguments and the values it computes are untouched.
A Triton without these internals is left alone.
"""

from __future__ import annotations

import inspect
import threading


def _langs(fn, tl) -> frozenset[int]:
    """ids of the language modules ``fn`` sees, as Triton's ``_patch_lang`` picks them."""
    return frozenset(
        id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
    )


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    grid_executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    error = getattr(interpreter, "InterpreterError", None)
    if grid_executor is None or function is None or error is None:
        return
    if not hasattr(interpreter, "_patch_lang") or not hasattr(function, "rewrite"):
        return
    if getattr(function.__call__, "skips_nested_patching", False):
        return
    plain_launch, plain_call = grid_executor.__call__, function.__call__
    # per thread: the language modules patched in each of its launches in progress
    local = threading.local()
    seen: dict[object, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        got = seen.get(fn)
        if got is None:
            got = seen[fn] = _langs(fn, tl)
        return got

    def launch(self, *args, **kwargs):
        patched = getattr(local, "patched", None)
        if patched is None:
            patched = local.patched = []
        patched.append(set(langs_of(self.fn)))
        try:
            return plain_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        patched = getattr(local, "patched", None)
        if not patched:
            return plain_call(self, *args, **kwargs)
        langs = langs_of(self.fn)
        if not langs <= patched[-1]:
            patched[-1].update(langs)  # Triton's call below patches them (they stay so)
            return plain_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device-function call reports it
            raise error(repr(e)) from e

    call.skips_nested_patching = True
    call.__wrapped__ = plain_call  # Triton's own device-function call
    grid_executor.__call__ = launch
    function.__call__ = call
