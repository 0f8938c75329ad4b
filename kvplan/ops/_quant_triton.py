"""Triton device functions for the quantization math of ``kvplan.quant``.

Everything that rounds is done in integer arithmetic (or IEEE ``div_rn``), so the kernels match
the torch path bit for bit both on the GPU and in the CPU interpreter (whose float casts to
fp8/bf16 do not round correctly).
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit

# scale-factor kinds (constexpr selectors)
SF_UE8M0 = 0
SF_E4M3 = 1
SF_FP32 = 2
SF_KIND = {"ue8m0": SF_UE8M0, "e4m3": SF_E4M3, "fp32": SF_FP32}


@jit
def encode_minifloat(
    x, MBITS: tl.constexpr, EMIN: tl.constexpr, SIGN_BIT: tl.constexpr, QMAX: tl.constexpr
):
    """fp32 ``x`` -> int32 codes of a 1-sign/E/MBITS minifloat, RNE, saturating at QMAX.

    EMIN is the biased fp32 exponent of the format's smallest normal (121 for e4m3, 127 for
    e2m1); the sign lands in bit SIGN_BIT.
    """
    a = tl.minimum(tl.abs(x), QMAX)
    bits = a.to(tl.int32, bitcast=True)
    exp = bits >> 23
    mant = (bits & 0x7FFFFF) | 0x800000
    normal = exp >= EMIN
    shift = tl.where(normal, 23 - MBITS, tl.minimum(23 - MBITS + EMIN - exp, 25))
    one = mant * 0 + 1
    lsb = (mant >> shift) & 1
    q = (mant + (one << (shift - 1)) - 1 + lsb) >> shift
    code = tl.where(normal, ((exp - EMIN) << MBITS) + q, q)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << SIGN_BIT)


@jit
def encode_e4m3(x):
    return encode_minifloat(x, 3, 121, 7, 448.0)


@jit
def encode_e2m1_magnitude(x):
    """fp32 -> int32 e2m1 magnitude codes (0..7) of ``|x|``, RNE, saturating at 6."""
    return encode_e2m1_magnitude_raw(x) & 7


@jit
def encode_e2m1_magnitude_raw(x):
    """``encode_e2m1_magnitude`` before masking: bits 0..2 hold the code, bits 3..21 are zero
    and bits 22.. hold the constant 0x12D (callers mask once after packing two codes).

    The code of ``a = min(|x|, 6)`` is the nearest integer to the concave piecewise-linear map
    ``f(a) = min(2a, a + 2, a / 2 + 4)``, which sends the e2m1 grid 0, .5, 1, 1.5, 2, 3, 4, 6
    to 0..7 and its midpoints to half-integers (ties to even codes = even mantissas). Each line
    is evaluated as ``a * s + (M + c)`` with M = 1.5 * 2^23: the product is exact and the single
    fp32 rounding of the sum is the round-to-nearest-even integer; rounding is monotonic, so
    the min of the rounded lines is the rounded min.
    """
    a = tl.minimum(tl.abs(x), 6.0)
    r = tl.minimum(tl.minimum(a * 2.0 + 12582912.0, a + 12582914.0), a * 0.5 + 12582916.0)
    return r.to(tl.int32, bitcast=True)


@jit
def encode_e2m1(x):
    """fp32 -> int32 e2m1 codes (0..15) with the sign of ``x`` (same as
    ``encode_minifloat(x, 1, 127, 3, 6.0)`` with fewer, mostly fp32, instructions)."""
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return encode_e2m1_magnitude(x) | (sign << 3)


INT8_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 ulp 1 on [2^23, 2^24)
INT8_RNE_BITS = tl.constexpr(0x4B400000)  # its int32 bits


@jit
def encode_int8(x):
    """fp32 ``x`` (no NaN) -> int32 codes ``clamp(RNE(x), -127, 127)`` (``kvplan.quant``).

    The clamped value plus 1.5 * 2^23 lies in [2^23, 2^24), where the fp32 ulp is 1, so that
    one IEEE addition rounds to the nearest integer with ties to even, on the GPU and in the
    interpreter alike; its bits minus those of 1.5 * 2^23 are the integer. -0.0 gives 0.
    """
    q = tl.minimum(tl.maximum(x, -127.0), 127.0)
    return (q + INT8_RNE_MAGIC).to(tl.int32, bitcast=True) - INT8_RNE_BITS


@jit
def decode_e4m3(c):
    """int32 e4m3 codes (0..255) -> fp32."""
    sign = (c >> 7) & 1
    exp = (c >> 3) & 15
    mant = c & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125  # mant * 2^-9
    # set the sign bit directly: Triton negates as 0 - x, which loses negative zero
    sub = (sub.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    return tl.where(exp > 0, normal, sub)


@jit
def decode_e2m1(c):
    """int32 e2m1 codes (0..15) -> fp32, exactly.

    ``(c & 7) << 9`` puts the 2 exponent bits and the mantissa bit where fp16 keeps its lowest
    exponent bits and top mantissa bit, so the fp16 with those bits (the sign moved to bit 15)
    is the e2m1 value times 2^-14 -- subnormal codes included, since both formats start their
    normal range at their exponent field 1. One fp16 -> fp32 conversion and one exact multiply.
    """
    return decode_e2m1_tiny(c) * 16384.0


@jit
def decode_e2m1_tiny(c):
    """The e2m1 value times 2^-14 (see ``decode_e2m1``), for callers that fold the 2^14 into a
    scale factor."""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def pow2(e):
    """2^e as fp32 for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def ue8m0_exponent(amax, QMAX: tl.constexpr):
    """ceil(log2(max(amax, 1e-4) / QMAX)) as int32, exactly."""
    s = tl.div_rn(tl.maximum(amax, 1e-4), amax * 0 + QMAX)
    bits = s.to(tl.int32, bitcast=True)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@jit
def bf16_bits(x):
    """fp32 -> the 16 bits of its round-to-nearest-even BF16 value, as int32 (0..65535)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@jit
def scale_multipliers(sbytes, SF: tl.constexpr):
    """Scale bytes -> fp32 dequantization multipliers.

    ``sbytes``: int32 ``[R, G]`` (ue8m0 / e4m3, one byte each) or ``[R, G, 4]`` (fp32,
    little-endian bytes; the result drops the last axis).
    """
    if SF == 0:
        return (sbytes << 23).to(tl.float32, bitcast=True)
    elif SF == 1:
        return decode_e4m3(sbytes)
    else:
        even, odd = tl.split(tl.reshape(sbytes, [sbytes.shape[0], sbytes.shape[1], 2, 2]))
        b0, b2 = tl.split(even)
        b1, b3 = tl.split(odd)
        word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        return word.to(tl.float32, bitcast=True)
