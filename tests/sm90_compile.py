"""Compile a Triton kernel for sm_90 on any machine (shared by the index-op tests).

The CPU interpreter skips Triton's type checks; compiling for the H200's architecture here
catches what would only fail on the GPU (e.g. names bound with different types in both branches
of an ``if``). Needs only Triton's bundled ptxas, not a GPU.
"""

import pytest
import triton


def compile_sm90(kernel, **constexprs):
    """Compile a kernel for sm_90 (H100/H200) on any machine: the interpreter does not run
    Triton's type checks (e.g. equal types for names bound in both branches of an ``if``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - no CUDA toolchain in this Triton install
        pytest.skip(f"no ptxas: {e}")
    fn = JITFunction(kernel.fn)  # the interpreter wraps the raw function
    sig = {n: "constexpr" if n in constexprs else "*i32" if n.endswith("_ptr") else "i32"
           for n in fn.arg_names}  # fmt: skip
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))  # fmt: skip
