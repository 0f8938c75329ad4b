"""Quantization math of the KV cache formats (vectorized torch), shared by the CPU paths of
``store_kv_cache`` / ``load_paged_kv_cache``; the Triton kernels mirror it bit for bit.

Semantics (they define the bytes; the GPU kernel must reproduce them exactly):

* amax of a group is taken over the BF16 input values (as fp32); the last group of a token may
  be shorter than ``elements_per_sf``.
* UE8M0 scale: ``e = ceil(log2(max(amax, 1e-4) / QMAX))`` (fp32 division), QMAX = 448 (e4m3) or
  6 (e2m1); ``value = RNE(x * 2^-e)`` in the target type (equal to ``x / 2^e``); the stored byte
  is ``e + 127`` and dequantization multiplies by ``2^(byte - 127)``.
* e4m3 scale (V41_FP4): ``sf = e4m3(min(max(amax, QMAX * 2^-9) / QMAX, 448))``;
  ``value = e2m1(x * (1 / sf))`` with ``1 / sf`` rounded to fp32 once, so store and load use the
  same rounded scale; dequantization multiplies by ``sf``.
* fp32 scale: ``sf = max(amax, 1e-4) / QMAX``; ``value = e4m3(x / sf)``; dequantization
  multiplies by ``sf``.
* Searched fp32 scale (``layout.scale_search``, e4m3 values): with ``a = max(amax, 1e-4)``
  the candidates are ``sf_c = a / c`` (fp32 division) for ``c`` in ``SEARCH_CANDIDATES`` =
  448, 416, 384, 352, 320, 288, 256, 240, 224: every e4m3 value in [224, 448], i.e. every
  place on the e4m3 grid the group's largest value can take across one binade of scale (it is
  stored as ``c`` under ``sf_c``). Each candidate's error is taken in the group's fixed point:
  ``P = 2^(12 - r)`` with ``r`` the unbiased exponent of ``a``'s fp32 bits,
  ``X_j = rint(x_j * P)`` and ``D_j = rint(e4m3(x_j * (c / a)) * (sf_c * P))`` (int32, rounded
  half to even, so a value the candidate stores exactly has ``D_j = X_j``; ``c / a`` one fp32
  division, ``sf_c * P`` exact), ``t_j = (|D_j - X_j| * |X_j|) >> 10`` and
  ``err_c = sum_j t_j^2``: integers all the way (``|X_j| < 2^13``, ``t_j < 2^12 + 2^5``, so the
  sum stays below 2^30), exact and independent of summation order, so every path picks the same
  scale. The least error wins, ties to the earlier candidate (448, the plain rule); the values
  are then encoded as under a plain fp32 scale, ``e4m3(x / sf)``. The weight ``|X_j|`` counts
  the rounding of the large values, which carry most of ``q.k``: SmolLM2's keys have outlier
  channels (max / RMS 6-10), and placing the top few of a group on grid points instead of only
  the largest halves the KL of its fp8 cache (bench/RESULTS.md, "Searched fp32 scales").
* int8 values (fp32 scale only), QMAX = 127: ``value = clamp(RNE(x / sf), -127, 127)`` as a
  two's-complement byte (``x / sf`` may round just above 127, hence the clamp); -128 is never
  stored and there is no negative zero (a negative value that rounds to zero is stored as 0).
  RNE here is round half to even to an integer (``torch.round``; the kernels add 1.5 * 2^23 in
  fp32, whose one rounding is that integer, exact for ``|x / sf| <= 2^22``).
* Encoding rounds to nearest, ties to even, and saturates at +-QMAX (only reachable with the
  e4m3 scale, whose rounding or the 448 clamp can leave ``x * (1 / sf)`` above QMAX). The sign is
  kept (minifloats), so a negative value that rounds to zero is stored as negative zero.
* FP4 packs element 2i in the low nibble of byte i.
* Non-finite inputs (what ``store_kv_cache(check=False)`` stores; ``check=True`` rejects them):
  a group is quantized as if its inf and NaN elements were +0 (so amax, the scale and every
  finite element's code are those of the finite values alone), then each +-inf element takes
  the code of +-QMAX (it loads back as +-QMAX times the group's scale, the largest magnitude
  the group can hold) and each NaN the code of +0 (it loads back as 0). Bytes are equal on
  every path; groups without non-finite elements are unaffected.
* A cast load returns ``bf16(fp32(value) * fp32(scale))`` (one fp32 product, one RNE to BF16).
"""

from __future__ import annotations

import math

import torch

from kvplan.formats import KVCacheFormat

E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-4
E4M3_MIN_SUBNORMAL = 2.0**-9

# (mantissa bits, biased fp32 exponent of the smallest normal, sign bit position, QMAX)
_MINIFLOAT = {"e4m3": (3, 121, 7, E4M3_MAX), "e2m1": (1, 127, 3, E2M1_MAX)}
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QMAX = {"e4m3": E4M3_MAX, "e2m1": E2M1_MAX, "int8": INT8_MAX}
# the e4m3 values in [224, 448], largest first: the scales a searched fp32 scale tries
SEARCH_CANDIDATES = (448.0, 416.0, 384.0, 352.0, 320.0, 288.0, 256.0, 240.0, 224.0)
SEARCH_FIXED_BITS = 12  # X_j = rint(x_j * 2^(12 - r)): |X_j| <= 2^13
# searched e4m3 scales of e2m1 values: the plain rule's code plus these steps (one binade of
# larger scales, then one step smaller, which saturates the largest value)
SEARCH_E4M3_STEPS = (0, 1, 2, 3, 4, 5, 6, 7, 8, -1)
SEARCH_SHIFT_E2M1 = 14  # |D_j - X_j| <= |X_j| + 1 there: t_j < 2^12 + 1, 16 t_j^2 < 2^29
SEARCH_SHIFT = 10  # t_j = (|D_j - X_j| * |X_j|) >> 10 < 2^12 + 2^4: sum_j t_j^2 < 2^30 (int32)


def encode_int8(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` -> int8 codes as uint8 bytes: ``clamp(RNE(x), -127, 127)`` (+-inf saturate;
    NaN must not reach it)."""
    q = torch.round(x.float().clamp(-INT8_MAX, INT8_MAX))
    return q.to(torch.int8).view(torch.uint8)


def decode_int8(codes: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of int8 codes -> fp32."""
    return codes.view(torch.int8).float()


def encode_minifloat(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Round fp32 ``x`` to e4m3 / e2m1 codes (RNE, saturating), as uint8 (e2m1: 0..15).

    Integer arithmetic only: the fp32 mantissa (with its implicit bit) is shifted right with
    round-half-to-even; below the smallest normal the shift grows so the quantum stays the
    subnormal step (2^-9 for e4m3, 0.5 for e2m1).
    """
    mbits, emin, sign_bit, qmax = _MINIFLOAT[dtype]
    x = x.float()
    bits = x.abs().clamp(max=qmax).view(torch.int32)
    exp = bits >> 23
    mant = (bits & 0x7FFFFF) | 0x800000
    normal = exp >= emin
    shift = torch.where(normal, 23 - mbits, (23 - mbits + emin - exp).clamp(max=25))
    lsb = (mant >> shift) & 1
    q = (mant + (1 << (shift - 1)) - 1 + lsb) >> shift
    code = torch.where(normal, ((exp - emin) << mbits) + q, q)
    sign = (x.view(torch.int32) >> 31) & 1
    return (code | (sign << sign_bit)).to(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> fp32."""
    return codes.view(torch.float8_e4m3fn).float()


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15, one per byte) -> fp32."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def ue8m0_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``ceil(log2(max(amax, 1e-4) / qmax))`` as int32, exactly (from the fp32 bits)."""
    s = div_rn(amax.float().clamp(min=AMAX_FLOOR), qmax)
    bits = s.view(torch.int32)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def div_rn(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded fp32 ``a / b``. A Python-scalar divisor is expanded to a tensor first:
    on CUDA, PyTorch divides by a scalar as ``a * (1 / b)``, which is not correctly rounded."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return a / b


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int32 e in [-126, 127]."""
    return ((exponent + 127) << 23).view(torch.float32)


def _grouped(x: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """BF16 ``[n, elements]`` -> fp32 ``[n, num_scales, elements_per_sf]``, zero padded."""
    n, elements = x.shape
    padded = layout.num_scales * layout.elements_per_sf
    xf = torch.nn.functional.pad(x.float(), (0, padded - elements))
    return xf.view(n, layout.num_scales, layout.elements_per_sf)


def quantize(x: torch.Tensor, layout: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize BF16 ``x`` ``[n, elements]`` to the record bytes of ``layout``.

    Returns ``(values, scales)``: uint8 ``[n, quantized_bytes]`` and uint8 ``[n, sf_bytes]``
    (fp32 scales as their little-endian bytes). Non-finite elements follow the rule of the
    module docstring (+-inf -> +-QMAX, NaN -> +0, scales from the finite elements).
    """
    assert layout.is_quantized, "quantize needs a quantized layout"
    xg = _grouped(x, layout)  # [n, G, GS]
    finite = torch.isfinite(xg)
    xz = torch.where(finite, xg, 0.0)  # inf and NaN count as +0 for the scale
    amax = xz.abs().amax(dim=-1)  # [n, G]
    dtype = layout.quantized_dtype
    qmax = QMAX[dtype]
    if layout.sf_format == "ue8m0":
        exp = ue8m0_exponent(amax, qmax)
        scaled = xz * pow2(-exp)[..., None]
        scales = (exp + 127).to(torch.uint8)
    elif layout.sf_format == "e4m3":
        sf = div_rn(amax.clamp(min=E4M3_MIN_SUBNORMAL * qmax), qmax).clamp(max=E4M3_MAX)
        scales = encode_minifloat(sf, "e4m3")
        if layout.scale_search:
            scales = searched_e4m3_scales(xz, amax, scales)
        sf_val = decode_e4m3(scales)
        inv = div_rn(torch.ones_like(sf_val), sf_val)
        scaled = xz * inv[..., None]
    else:
        if layout.scale_search:
            sf = searched_scales(xz, amax)
        else:
            sf = div_rn(amax.clamp(min=AMAX_FLOOR), qmax)
        scaled = xz / sf[..., None]
        scales = sf.contiguous().view(torch.uint8)  # [n, 4 * G]: each scale's bytes
    # +-inf saturates to +-QMAX (the encoder clamps it); NaN stays the +0 of xz
    scaled = torch.where(torch.isinf(xg), xg, scaled)
    codes = encode_int8(scaled) if dtype == "int8" else encode_minifloat(scaled, dtype)
    codes = codes.flatten(1)[:, : layout.quantized_elements]
    if dtype == "e2m1":
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.contiguous(), scales.contiguous()


def searched_scales(xz: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The searched fp32 scales (module docstring) of finite fp32 groups ``xz [..., GS]``
    (BF16 values) with maxima ``amax [...]`` -> fp32 ``[...]``."""
    a, p, x_abs = _fixed_point(xz, amax)

    def candidates():
        for c in SEARCH_CANDIDATES:
            sf = div_rn(a, c)
            y = xz * div_rn(torch.full_like(a, c), a)[..., None]
            mag = decode_e4m3(encode_minifloat(y, "e4m3")).abs()
            yield sf, _search_error(mag, sf * p, x_abs, SEARCH_SHIFT)

    return _least_error(candidates())


def searched_e4m3_scales(xz: torch.Tensor, amax: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The searched e4m3 scale codes (e2m1 values; module docstring) of finite fp32 groups
    ``xz [..., GS]`` with maxima ``amax`` and plain-rule codes ``base`` (uint8) -> uint8."""
    _, p, x_abs = _fixed_point(xz, amax)

    def candidates():
        for step in SEARCH_E4M3_STEPS:
            code = (base.to(torch.int32) + step).clamp(1, 126).to(torch.uint8)
            sf = decode_e4m3(code)
            y = xz * div_rn(torch.ones_like(sf), sf)[..., None]
            mag = decode_e2m1(encode_minifloat(y, "e2m1") & 7)
            yield code, _search_error(mag, sf * p, x_abs, SEARCH_SHIFT_E2M1)

    return _least_error(candidates())


def _fixed_point(xz: torch.Tensor, amax: torch.Tensor):
    """``(a, P, |X|)`` of the scale search: ``a = max(amax, 1e-4)``, ``P = 2^(12 - r)`` per
    group, ``|X| = |rint(x * P)|`` (int32, half to even)."""
    a = amax.float().clamp(min=AMAX_FLOOR)
    p = pow2(SEARCH_FIXED_BITS - ((a.view(torch.int32) >> 23) - 127))
    return a, p, torch.round(xz * p[..., None]).to(torch.int32).abs()


def _search_error(mag, scale_p, x_abs, shift: int) -> torch.Tensor:
    """``sum(((|D - X| * |X|) >> shift)^2)`` per group, ``D = rint(mag * scale_p)`` (int32)."""
    d = torch.round(mag * scale_p[..., None]).to(torch.int32)
    t = ((d - x_abs).abs() * x_abs) >> shift
    return (t * t).sum(-1)


def _least_error(candidates):
    """Per group, the first candidate value of ``(value, error)`` pairs with the least error."""
    best = best_err = None
    for value, err in candidates:
        if best is None:
            best, best_err = value, err
        else:
            better = err < best_err
            best = torch.where(better, value, best)
            best_err = torch.where(better, err, best_err)
    return best


def scale_factors(scales: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """Scale bytes uint8 ``[n, sf_bytes]`` -> fp32 multipliers ``[n, num_scales]``."""
    if layout.sf_format == "ue8m0":
        return (scales.to(torch.int32) << 23).view(torch.float32)
    if layout.sf_format == "e4m3":
        return decode_e4m3(scales)
    return scales.contiguous().view(torch.float32)


def dequantize(values: torch.Tensor, scales: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """Record bytes -> BF16 ``[n, elements]``: ``bf16(fp32(value) * fp32(scale))``."""
    if layout.quantized_dtype == "e2m1":
        pairs = torch.stack((values & 15, values >> 4), dim=-1).flatten(1)
        v = decode_e2m1(pairs)
    elif layout.quantized_dtype == "int8":
        v = decode_int8(values)
    else:
        v = decode_e4m3(values)
    sf = scale_factors(scales, layout)  # [n, G]
    group = torch.arange(layout.quantized_elements, device=values.device)
    group = group // layout.elements_per_sf
    return (v * sf[:, group]).to(torch.bfloat16)


# ---- scalar references (per element, obviously correct; tests only) ----


def encode_e2m1_ref(v: float) -> int:
    """Nearest e2m1 code by table search, ties to the even code, saturating, sign kept."""
    a = min(abs(v), E2M1_MAX)
    best = min(range(8), key=lambda c: (abs(_E2M1_VALUES[c] - a), c % 2))
    negative = v < 0 or (v == 0 and str(v).startswith("-"))
    return best | (8 if negative else 0)


def encode_e4m3_ref(v: torch.Tensor) -> int:
    """e4m3 code of one fp32 value through torch's own float8 conversion (after saturation)."""
    return int(v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))


def quantize_group_ref(xs: list[float], layout: KVCacheFormat) -> tuple[list[int], list[int]]:
    """One group of BF16 values (as Python floats) -> (element codes, scale bytes), scalar fp32
    arithmetic through numpy. Codes are e4m3 / int8 bytes or e2m1 nibbles (not yet packed).
    Non-finite values: the scale comes from the finite ones, +-inf -> +-QMAX, NaN -> +0."""
    import numpy as np

    f32 = np.float32
    xs = [0.0 if math.isnan(v) else v for v in xs]
    amax = f32(max((abs(v) for v in xs if math.isfinite(v)), default=0.0))
    dtype = layout.quantized_dtype
    qmax = f32(QMAX[dtype])

    def encode(v: np.float32) -> int:
        if math.isinf(v):
            v = f32(math.copysign(float(qmax), v))
        if dtype == "int8":  # Python's round() is half to even
            return round(min(max(float(v), -127.0), 127.0)) & 255
        if dtype == "e2m1":
            return encode_e2m1_ref(float(v))
        return encode_e4m3_ref(torch.tensor(float(v), dtype=torch.float32))

    if layout.sf_format == "ue8m0":
        s = max(amax, f32(AMAX_FLOOR)) / qmax
        mantissa, exponent = math.frexp(float(s))
        e = exponent - 1 if mantissa == 0.5 else exponent
        codes = [encode(f32(v) / f32(2.0**e)) for v in xs]
        return codes, [e + 127]
    if layout.sf_format == "e4m3":
        s = min(max(amax, f32(E4M3_MIN_SUBNORMAL) * qmax) / qmax, f32(E4M3_MAX))
        code = encode_e4m3_ref(torch.tensor(float(s), dtype=torch.float32))
        if layout.scale_search:
            code = _searched_e4m3_code_ref([v if math.isfinite(v) else 0.0 for v in xs], amax, code)
        sf = f32(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).item())
        inv = f32(1.0) / sf
        return [encode(f32(v) * inv) for v in xs], [code]
    sf = max(amax, f32(AMAX_FLOOR)) / qmax
    if layout.scale_search:
        sf = _searched_scale_ref([v if math.isfinite(v) else 0.0 for v in xs], amax)
    return [encode(f32(v) / sf) for v in xs], list(np.array([sf], dtype=np.float32).view(np.uint8))


def _searched_e4m3_code_ref(xs: list[float], amax, base: int) -> int:
    """The searched e4m3 scale code of one finite e2m1 group, value by value (tests only)."""
    import numpy as np

    f32 = np.float32
    _, p, x_abs = _fixed_point_ref(xs, amax)
    best, best_err = None, None
    for step in SEARCH_E4M3_STEPS:
        code = min(max(base + step, 1), 126)
        sf = f32(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).item())
        inv = f32(1.0) / sf
        mags = [f32(_E2M1_VALUES[encode_e2m1_ref(float(f32(v) * inv)) & 7]) for v in xs]
        err = _search_error_ref(mags, sf * p, x_abs, SEARCH_SHIFT_E2M1)
        if best_err is None or err < best_err:
            best, best_err = code, err
    return best


def _searched_scale_ref(xs: list[float], amax) -> float:
    """The searched fp32 scale of one finite group, one value at a time (tests only)."""
    import numpy as np

    f32 = np.float32
    a, p, x_abs = _fixed_point_ref(xs, amax)
    best_sf, best_err = None, None
    for c in SEARCH_CANDIDATES:
        sf, inv = a / f32(c), f32(c) / a
        codes = [encode_e4m3_ref(torch.tensor(float(f32(v) * inv))) for v in xs]
        values = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mags = [f32(abs(v)) for v in values.tolist()]
        err = _search_error_ref(mags, sf * p, x_abs, SEARCH_SHIFT)
        if best_err is None or err < best_err:
            best_sf, best_err = sf, err
    return best_sf


def _fixed_point_ref(xs: list[float], amax):
    """Scalar ``(a, P, [|X_j|])`` of the scale search (`_fixed_point`)."""
    import numpy as np

    f32 = np.float32
    a = max(f32(amax), f32(AMAX_FLOOR))
    r = int(np.array([a], dtype=np.float32).view(np.int32)[0] >> 23) - 127
    p = f32(2.0 ** (SEARCH_FIXED_BITS - r))
    return a, p, [abs(round(float(f32(v) * p))) for v in xs]  # round(): half to even


def _search_error_ref(mags, scale_p, x_abs: list[int], shift: int) -> int:
    """Scalar `_search_error`: ``sum(((|rint(m * scale_p) - X| * X) >> shift)^2)``."""
    err = 0
    for m, xv in zip(mags, x_abs, strict=True):
        t = (abs(round(float(m * scale_p)) - xv) * xv) >> shift
        err += t * t
    return err


def dequantize_ref(vbytes: list[int], sbytes: list[int], layout: KVCacheFormat) -> torch.Tensor:
    """One record's bytes -> BF16 ``[elements]``, element by element (tests only)."""
    import struct

    import numpy as np

    f32 = np.float32
    if layout.quantized_dtype == "e2m1":
        codes = [c for b in vbytes for c in (b & 15, b >> 4)]
        vals = [f32(_E2M1_VALUES[c & 7] * (-1.0 if c & 8 else 1.0)) for c in codes]
    elif layout.quantized_dtype == "int8":
        vals = [f32(b - 256 if b > 127 else b) for b in vbytes]
    else:
        as_fp8 = torch.tensor(vbytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
        vals = [f32(v) for v in as_fp8.float().tolist()]
    if layout.sf_format == "ue8m0":
        scales = [f32(2.0 ** (b - 127)) for b in sbytes]
    elif layout.sf_format == "e4m3":
        as_fp8 = torch.tensor(sbytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = [f32(v) for v in as_fp8.float().tolist()]
    else:
        scales = [f32(v) for v in struct.unpack(f"<{len(sbytes) // 4}f", bytes(sbytes))]
    per = layout.elements_per_sf
    prods = [vals[e] * scales[e // per] for e in range(len(vals))]
    return torch.tensor(np.array(prods, dtype=np.float32)).to(torch.bfloat16)
