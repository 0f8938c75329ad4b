"""Record every Triton kernel launch the CPU interpreter runs, for an offline GPU compile.

The interpreter accepts code the GPU compiler rejects (layout conflicts, non-constexpr
globals, ...). With ``KVPLAN_RECORD_KERNELS=path`` set, the test session appends one JSON line
per distinct specialization (kernel, argument types, divisibility attributes, constexpr
values, ``num_warps`` / ``num_stages``) to ``path``, computed the way Triton's launcher would
for the same arguments on a GPU; ``tools/compile_sm90.py`` then compiles each line for an
sm_90 target on this CPU-only machine (no GPU needed to compile).
"""

from __future__ import annotations

import json
import os

_SEEN: set[str] = set()
_SPECIALIZE_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")


def _jsonable(value):
    if type(value).__name__ == "constexpr":  # a tl.constexpr wrapper: record its value
        value = value.value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return repr(value)  # e.g. a tl.dtype constexpr: the compile tool maps it back


def install(path: str) -> None:
    """Wrap ``InterpretedFunction.run`` so each launch is recorded before it runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            fn = self.fn
            if fn not in binders:  # the decorator's specialization switches, as on the GPU
                kw = getattr(self, "kwargs", {})
                jf = JITFunction(fn, **{k: kw[k] for k in _SPECIALIZE_OPTIONS if kw.get(k)})
                binders[fn] = (jf, create_function_from_signature(jf.signature, jf.params, backend))
            jf, binder = binders[fn]
            bound, spec, options = binder(*args, **kwargs)
            opts, signature, constexprs, attrs = jf._pack_args(
                backend, dict(kwargs), bound, spec, options
            )
            line = json.dumps(
                {
                    "module": fn.__module__,
                    "name": fn.__name__,
                    "signature": signature,
                    "constexprs": [[list(k), _jsonable(v)] for k, v in constexprs.items()],
                    "attrs": [[list(k), _jsonable(v)] for k, v in attrs.items()],
                    "num_warps": opts.num_warps,
                    "num_stages": opts.num_stages,
                },
                sort_keys=True,
            )
            if line not in _SEEN:
                _SEEN.add(line)
                with open(path, "a") as fh:
                    fh.write(line + "\n")
        except Exception as exc:  # recording must never change what a test sees
            with open(path + ".errors", "a") as fh:
                fh.write(f"{getattr(self, '__name__', self)}: {exc!r}\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run


if os.environ.get("KVPLAN_RECORD_KERNELS"):
    install(os.environ["KVPLAN_RECORD_KERNELS"])
