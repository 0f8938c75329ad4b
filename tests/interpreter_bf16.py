"""Triton 3.6's CPU interpreter keeps bf16 tensors as their uint16 bits and its ``tl.dot``
multiplies those bits as integers (``np.matmul`` on the raw storage), so every bf16 MMA of a
kernel under ``TRITON_INTERPRET=1`` returns garbage. `install` makes the interpreter's dot
widen bf16 operands to fp32 first (exact: a bf16 is the top half of an fp32), which is what
the GPU's bf16 MMA computes up to the order of its fp32 sums. ``tests/conftest.py`` installs
it whenever the interpreter runs."""

from __future__ import annotations

import numpy as np


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    plain = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return plain(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True
    builder.create_dot = create_dot
