"""Three bf16 faults of Triton 3.6's CPU interpreter, fixed for the test suite.

The interpreter keeps bf16 tensors as their uint16 bits, and

* its ``tl.dot`` multiplies those bits as integers (``np.matmul`` on the raw storage), so
  every bf16 MMA of a kernel under ``TRITON_INTERPRET=1`` returned garbage;
* its elementwise float arithmetic and comparisons on two bf16 operands (``x * y``,
  ``x + y``, ``tl.maximum``, ``x < y``, ...) work on those bits as integers too (1.5 * 2.0
  gave 0.0);
* its fp32 -> bf16 cast drops the low 16 bits (rounds toward zero), where the GPU and torch
  round to nearest even.

`install` makes the dot widen bf16 operands to fp32 first (exact: a bf16 is the top half of
an fp32; the GPU's bf16 MMA computes the same products, up to the order of its fp32 sums),
the elementwise operations compute on the widened values and round the result to nearest
even (exact products, as the GPU's bf16 multiply gives them; a sum is rounded twice, through
fp32, as Triton's lowering does where the GPU has no bf16 adder), and the cast round to
nearest even (NaN stays NaN). ``kvplan.ops`` installs both when it is
imported with ``TRITON_INTERPRET=1`` (`kvplan.ops._dispatch`), so the kernels' bf16 paths give
values on the CPU, in the tests and in the benches' ``--quick`` runs alike. A Triton without
these builder methods is left alone."""

from __future__ import annotations

import numpy as np


def bf16_bits_rne(f32: np.ndarray) -> np.ndarray:
    """fp32 values -> the uint16 bits of their round-to-nearest-even bf16 (quiet NaN kept)."""
    bits = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot") or not hasattr(builder, "cast_impl"):
        return
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    plain_dot, plain_cast = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return plain_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bf16_bits_rne(src.data), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    create_dot.widens_bf16 = True
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    for name in _FLOAT_OPS + _FLOAT_COMPARES:
        if hasattr(builder, name):
            rounds = name in _FLOAT_OPS
            setattr(builder, name, _bf16_binary(getattr(builder, name), widen, rounds))


# the builder's float operations on two operands, the arithmetic ones and the compares
_FLOAT_OPS = (
    "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf",
    "create_frem", "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf",
)  # fmt: skip
_FLOAT_COMPARES = tuple(
    f"create_fcmp{o}{k}" for o in "OU" for k in ("LT", "GT", "LE", "GE", "EQ", "NE")
)


def _bf16_binary(plain, widen, rounds: bool = True):
    """``plain`` (a builder method on two operands) on two bf16 operands: on the operands
    widened to fp32, the result rounded to bf16 (``rounds``) or kept as it comes (a
    compare's); other operands as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    def method(self, lhs, rhs):
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return plain(self, lhs, rhs)
        with np.errstate(all="ignore"):
            out = plain(self, widen(lhs), widen(rhs))
        if not rounds:
            return out
        return interpreter.TensorHandle(bf16_bits_rne(out.data), tl.bfloat16)

    return method
