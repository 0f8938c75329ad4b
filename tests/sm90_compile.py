"""Compile a Triton kernel for sm_90 on any machine (shared by the kernel tests).

The CPU interpreter skips Triton's type checks; compiling for the H200's architecture here
catches what would only fail on the GPU (e.g. names bound with different types in both branches
of an ``if``). Needs only Triton's bundled ptxas, not a GPU.

The compile runs in a fresh Python process without ``TRITON_INTERPRET``: the interpreter patches
``triton.language`` while it runs a kernel, and a compile in the same process can then fail
depending on which tests ran before it.
"""

import inspect
import json
import os
import subprocess
import sys
from typing import NamedTuple

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import importlib, json, sys
try:
    from triton.backends.nvidia.compiler import get_ptxas
    get_ptxas(90)
except Exception as e:  # no CUDA toolchain in this Triton install
    print("NO_PTXAS", e)
    sys.exit(0)
from tools.compile_sm90 import compile_kernel, ptxas_report

module, name, constexprs, types, ptr_dtype, div16, options, stats = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
sig = {n: "constexpr" if n in constexprs else types.get(n) or (ptr_dtype if n.endswith("_ptr")
       else "i32") for n in fn.arg_names}
attrs = {(i,): [("tt.divisibility", 16)] for i, n in enumerate(fn.arg_names) if n in div16}
ck = compile_kernel(fn, sig, constexprs, attrs or None, options)
if isinstance(stats, list):  # the opcodes to count per loop of the sm_90 code
    from tools.compile_sm90 import sass_loop_ops
    print("RESULT", json.dumps(sass_loop_ops(ck.asm["cubin"], tuple(stats))))
elif stats:
    ptx = ck.asm["ptx"]
    regs, spills = ptxas_report(ptx)
    print("RESULT", json.dumps([regs, spills, ck.metadata.shared, "wgmma" in ptx,
                                "cp.async" in ptx]))
else:
    print("OK")
"""


def _compile(kernel, constexprs, signature, ptr_dtype, div16=(), options=None, stats=False):
    """Run the compile in a fresh process: its stdout, or fail / skip the test."""
    raw = getattr(kernel, "fn", kernel)  # JITFunction or the interpreter's wrapper
    spec = json.dumps([raw.__module__, raw.__name__, constexprs, signature or {}, ptr_dtype,
                       sorted(div16), options, stats])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, spec], capture_output=True,
                          text=True, env=env, cwd=_ROOT, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"sm_90 compile of {raw.__name__} failed:\n{proc.stderr[-3000:]}")
    if proc.stdout.startswith("NO_PTXAS"):
        pytest.skip(f"no ptxas: {proc.stdout.strip()}")
    return proc.stdout


def compile_sm90(
    kernel, ptr_dtype: str = "*i32", signature: dict[str, str] | None = None, **constexprs
) -> None:
    """Compile ``kernel`` (a module-level ``@triton.jit`` function) for sm_90 or fail the test.

    Argument types: ``signature[name]`` where given, else ``ptr_dtype`` for pointer arguments
    (names ending in ``_ptr``) and i32 for the other runtime arguments.
    """
    out = _compile(kernel, constexprs, signature, ptr_dtype)
    assert out.strip().endswith("OK"), out


def kernel_arg_names(kernel) -> list[str]:
    """Argument names of a ``@triton.jit`` function (a JITFunction or the interpreter's)."""
    raw = getattr(kernel, "fn", kernel)
    names = getattr(raw, "arg_names", None)
    return list(names) if names is not None else list(inspect.signature(raw).parameters)


def sm90_loop_ops(
    kernel, constexprs: dict, ops: tuple[str, ...], *, signature: dict[str, str] | None = None,
    ptr_dtype: str = "*i32", num_warps: int = 4,
) -> list[dict[str, int]]:  # fmt: skip
    """Per loop of ``kernel``'s sm_90 code: its length and the count of each opcode in
    ``ops`` in one iteration (`tools.compile_sm90.sass_loop_ops`); skips without ptxas."""
    out = _compile(kernel, constexprs, signature, ptr_dtype, (), {"num_warps": num_warps},
                   stats=list(ops))  # fmt: skip
    return json.loads(out.rsplit("RESULT", 1)[1])


class Sm90Stats(NamedTuple):
    """What ptxas reports for one sm_90 specialization, and two features of its PTX."""

    registers: int  # per thread
    spill_bytes: int  # spill stores
    shared_bytes: int
    wgmma: bool  # dots on Hopper's warpgroup tensor-core path
    cp_async: bool  # asynchronous (software-pipelined) loads


def sm90_stats(
    kernel, constexprs: dict, *, signature: dict[str, str] | None = None,
    ptr_dtype: str = "*i32", div16: tuple[str, ...] | set[str] = (), num_warps: int = 4,
    num_stages: int | None = None,
) -> Sm90Stats:  # fmt: skip
    """Compile ``kernel`` for sm_90 (argument types as in `compile_sm90`; ``div16``: runtime
    arguments specialized as multiples of 16, as the launches make them) and return ptxas's
    register and spill counts; skips the test without ptxas, fails it on a compile error."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    out = _compile(kernel, constexprs, signature, ptr_dtype, div16, options, stats=True)
    return Sm90Stats(*json.loads(out.rsplit("RESULT", 1)[1]))
