"""The model's small ops, each as a torch path and a fused Triton kernel side by side.

* `rms_norm` -- RMSNorm, optionally fused with the residual add before it (vLLM style: the sum
  is written back into ``residual``, the new residual stream);
* `qkv_epilogue` -- split the ``qkv_proj`` output into contiguous q/k/v, with the optional
  Qwen3 per-head q/k RMSNorm and RoPE on q and k, in one kernel;
* `silu_and_mul` -- ``silu(gate) * up`` from the ``gate_up_proj`` output.

The ``*_torch`` functions are the model's unfused arithmetic (Hugging Face's, step by step);
the ``*_triton`` launchers repeat its rounding steps (see `kvplan.models._fused_kernels`).
Each dispatcher takes ``fused``: ``True`` runs the kernel, ``False`` the torch path, ``None``
the kernel for CUDA tensors (or with ``KVPLAN_FORCE_TRITON=1``). On CPU the kernels run only
under ``TRITON_INTERPRET=1``.

Agreement with the torch path on CUDA (``tests/models/test_fused_gpu.py``):

* ``silu_and_mul`` and ``qkv_epilogue`` without q/k norm: bit-exact (the same fp32 operations
  and roundings; the exponential is libdevice ``expf``, as in torch's ``silu``);
* ``rms_norm`` and the q/k norm: the residual sum is bit-exact; the fp32 sum of squares is
  reduced in another order than torch's, so where ``x * rsqrt(...)`` lies next to a rounding
  boundary of the model dtype it can round 1 ulp apart (rare; the GPU test asks >= 99% of the
  elements equal in bf16/fp16). The weight multiply turns that into at most 2 ulp of the
  output, and RoPE after the q/k norm into about one ulp of its larger product term. In fp32
  the outputs agree to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvplan._checks import check_tensor
from kvplan.models.rope import rotate_qk
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import triton_cdiv, triton_next_pow2
from kvplan.ops.split_linear import (  # noqa: F401 (re-exported: the model's ops)
    SPLIT_LINEAR_MIN_WEIGHT,
    SPLIT_LINEAR_ROWS,
    SplitSums,
    linear_splits,
    split_linear,
)


def _fused(t: torch.Tensor | SplitSums, fused: bool | None) -> bool:
    if isinstance(t, SplitSums):  # the partials' device decides
        t = t.sums
    return use_triton(t) if fused is None else fused


# --- rms_norm -------------------------------------------------------------------------------


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    fused: bool | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x [..., N]`` (or of ``x + residual``, written into ``residual``).

    Without ``residual``: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)``.
    With ``residual`` (same shape and dtype as ``x``): first ``residual += x`` in place (in the
    model dtype), then the norm of the new ``residual``.

    Args:
        x: ``[..., N]`` fp32/bf16/fp16.
        weight: ``[N]``, the dtype of ``x``.
        residual: optional ``[..., N]``, updated in place.

    Returns:
        ``[..., N]`` in the dtype of ``x`` (a new tensor).
    """
    if _fused(x, fused):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch path of `rms_norm` (the arithmetic of Hugging Face's ``LlamaRMSNorm``)."""
    if isinstance(x, SplitSums):
        x = x.total()
    if residual is not None:
        x = residual.add_(x)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton path of `rms_norm`: one kernel, one program per row (which also adds up the
    partials of a `SplitSums` ``x``)."""
    from kvplan.models._fused_kernels import rms_norm_kernel

    parts = stride_part = 0
    dtype = x.dtype
    if isinstance(x, SplitSums):
        parts, stride_part = x.sums.shape[0], x.sums.stride(0)
        x = x.sums[0]  # [T, N] fp32: the first partial's rows; the kernel adds the others
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != dtype:
        raise TypeError(f"weight must be [{n}] {dtype}, got {list(weight.shape)} {weight.dtype}")
    x2 = _rows(x, "x", in_place=parts > 0)  # partials are read in place
    res2 = x2
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != dtype:
            raise ValueError(
                f"residual must match x ({list(x.shape)} {dtype}), "
                f"got {list(residual.shape)} {residual.dtype}"
            )
        res2 = _rows(residual, "residual", in_place=True)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    tile = triton_next_pow2(n)
    if x2.shape[0] > 0:
        rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, n, x2.stride(0), res2.stride(0), 1.0 / n, eps,
            stride_part, HAS_RESIDUAL=residual is not None, TILE_N=tile, PARTS=parts,
            num_warps=max(1, min(16, tile // 512)), enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(x.shape)


def _rows(t: torch.Tensor, name: str, in_place: bool = False) -> torch.Tensor:
    """``t [..., N]`` as ``[R, N]`` rows with unit column stride (always a view when
    ``in_place``, so that the kernel's writes land in ``t``)."""
    n = t.shape[-1]
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if not in_place:
        rows = t.reshape(-1, n)
        return rows if rows.stride(1) == 1 else rows.contiguous()
    try:
        rows = t.view(-1, n)
    except RuntimeError:
        rows = None
    if rows is None or (n > 1 and rows.stride(1) != 1):
        raise ValueError(f"{name} must be viewable as [rows, {n}] rows, got strides {t.stride()}")
    return rows


# --- qkv_epilogue ---------------------------------------------------------------------------


def qkv_epilogue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv`` into contiguous q/k/v, apply the optional q/k norm, then RoPE to q and k.

    Layout of a row of ``qkv`` (D = head_dim)::

        [ q head 0 | ... | q head H-1 | k head 0 | ... | k head Hkv-1 | v head 0 | ... ]
          <-- H * D ------------------> <-- Hkv * D ---------------->  <-- Hkv * D -->

    Args:
        qkv: ``[T, (H + 2 Hkv) D]`` fp32/bf16/fp16, unit last-dim stride.
        positions: ``[T]`` int64/int32 absolute positions, ``< cos.shape[0]``.
        cos, sin: ``[P, D]`` RoPE tables (`RotaryTable.cos`/``.sin``), the dtype of ``qkv``.
        q_norm_weight, k_norm_weight: ``[D]`` per-head RMSNorm weights (Qwen3), both or neither.
        kv_store: ``(k_cache, v_cache, slots)``: also write each token's returned k and v rows,
            cast to the caches' float dtype, into the paged caches ``[blocks, block_size, Hkv,
            D]`` (heads and D contiguous, the same shape and strides) at ``slots[i]`` (int32 /
            int64 ``[T]``; outside ``[0, blocks * block_size)``, e.g. -1, writes nothing),
            as `KVCacheTensors.store` of a plain cache would, in the same kernel. A 4-tuple
            ``(k_cache, v_cache, slots, layout)`` names uint8 token-record caches of a
            quantized ``layout`` (e4m3 / int8, `fused_store_supports`): the rows are
            quantized as ``store_kv_cache`` quantizes them (the same bytes).

    Returns:
        ``(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])`` in the dtype of ``qkv``; all three
        contiguous from the kernel; the torch path returns ``v`` as a strided view of ``qkv``
        (as the unfused model always did; the backends accept it).
    """
    fn = qkv_epilogue_triton if _fused(qkv, fused) else qkv_epilogue_torch
    return fn(qkv, positions, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
              q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
              kv_store=kv_store)  # fmt: skip


def _head_dim(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] % heads:
        raise ValueError(
            f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] with "
            f"{num_heads} + 2 * {num_kv_heads} heads, got {list(qkv.shape)}"
        )
    return qkv.shape[1] // heads


def _check_kv_store(kv_store, t: int, num_kv_heads: int, d: int, device):
    """`qkv_epilogue`'s ``kv_store`` contract (see its docstring); returns the quantized
    layout, or None for plain caches."""
    if not (isinstance(kv_store, tuple) and len(kv_store) in (3, 4)):
        raise TypeError(
            "kv_store must be a (k_cache, v_cache, slots) or (k_cache, v_cache, slots, layout) "
            "tuple"
        )
    k_cache, v_cache, slots = kv_store[:3]
    layout = kv_store[3] if len(kv_store) == 4 else None
    check_tensor("kv_store slots", slots, dtype=(torch.int32, torch.int64), shape=(t,),
                 device=device)  # fmt: skip
    if layout is not None:
        _check_quantized_store(layout, num_kv_heads, d)
    for name, c in (("kv_store k_cache", k_cache), ("kv_store v_cache", v_cache)):
        if layout is not None:
            check_tensor(name, c, dtype=torch.uint8, ndim=4, device=device)
            if c.shape[2] != 1 or c.shape[3] < layout.bytes_per_token or c.stride(3) != 1:
                raise ValueError(
                    f"{name} must be uint8 [blocks, block_size, 1, >= "
                    f"{layout.bytes_per_token}] token records, got shape {list(c.shape)}"
                )
            continue
        check_tensor(name, c, dtype=_FLOATS, ndim=4, device=device)
        if c.shape[2:] != (num_kv_heads, d) or c.stride(3) != 1 or c.stride(2) != d:
            raise ValueError(
                f"{name} must be [blocks, block_size, {num_kv_heads}, {d}] with contiguous "
                f"heads, got shape {list(c.shape)} strides {c.stride()}"
            )
    if (v_cache.shape, v_cache.stride(), v_cache.dtype) != (
        k_cache.shape, k_cache.stride(), k_cache.dtype
    ):  # fmt: skip
        raise ValueError(
            f"kv_store caches differ: k {list(k_cache.shape)} {k_cache.stride()} "
            f"{k_cache.dtype}, v {list(v_cache.shape)} {v_cache.stride()} {v_cache.dtype}"
        )
    return layout


# quantized value dtypes the fused store writes (QUANT constexpr of qkv_epilogue_kernel)
_FUSED_QUANT = {"e4m3": 1, "e2m1": 2, "int8": 3}


def fused_store_supports(layout, head_dim: int) -> bool:
    """Whether `qkv_epilogue`'s ``kv_store`` can write a cache of ``layout`` (None: plain):
    plain caches, and e4m3 / e2m1 / int8 token records of whole per-head scale groups with a
    power-of-two ``head_dim``."""
    if layout is None:
        return True
    return (
        layout.quantized_dtype in _FUSED_QUANT
        and layout.token_interleaved
        and layout.bf16_elements == 0
        and head_dim == triton_next_pow2(head_dim)
        and head_dim % layout.elements_per_sf == 0
    )


def _check_quantized_store(layout, num_kv_heads: int, d: int) -> None:
    if not fused_store_supports(layout, d) or layout.quantized_elements != num_kv_heads * d:
        raise ValueError(
            f"kv_store layout {layout.note!r} is not one the fused store writes (e4m3 / e2m1 / int8 "
            f"token records of {num_kv_heads} heads x {d}, power-of-two head_dim)"
        )


def _pow2_divisor(*counts: int) -> int:
    """The largest power of two dividing every count."""
    d = 0
    for c in counts:
        d |= c
    return d & -d if d else 1


def _store_rows_torch(kv_store, k: torch.Tensor, v: torch.Tensor) -> None:
    """Sync-free scatter of ``k`` / ``v`` ``[T, Hkv, D]`` into ``kv_store``'s caches: a skipped
    row writes back what slot 0 already holds; quantized caches through ``store_kv_cache``."""
    k_cache, v_cache, slots = kv_store[:3]
    if len(kv_store) == 4:
        from kvplan.ops.store import store_kv_cache

        for x, cache in ((k, k_cache), (v, v_cache)):
            store_kv_cache(x.to(torch.bfloat16), cache, slots.to(torch.int32),
                           layout=kv_store[3], check=False)  # fmt: skip
        return
    blocks, bs = k_cache.shape[:2]
    keep = ((slots >= 0) & (slots < blocks * bs))[:, None, None]
    idx = torch.where(keep[:, 0, 0], slots, 0).long()
    block, offset = idx // bs, idx % bs
    for x, cache in ((k, k_cache), (v, v_cache)):
        cache[block, offset] = torch.where(keep, x.to(cache.dtype), cache[block, offset])


def qkv_epilogue_torch(
    qkv, positions, cos, sin, *, num_heads, num_kv_heads, q_norm_weight=None,
    k_norm_weight=None, eps=1e-6, kv_store=None,
):  # fmt: skip
    """Torch path of `qkv_epilogue` (views, per-op norm and rotation, then copies; the
    optional store as `KVCacheTensors.store` does it for a plain cache)."""
    if isinstance(qkv, SplitSums):
        qkv = qkv.total()
    t = qkv.shape[0]
    d = _head_dim(qkv, num_heads, num_kv_heads)
    if kv_store is not None:
        _check_kv_store(kv_store, t, num_kv_heads, d, qkv.device)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.view(t, num_heads, d)  # [T, H, D]
    k = k.view(t, num_kv_heads, d)  # [T, Hkv, D]
    v = v.reshape(t, num_kv_heads, d)  # [T, Hkv, D]
    if q_norm_weight is not None:
        q = rms_norm_torch(q, q_norm_weight, eps)
        k = rms_norm_torch(k, k_norm_weight, eps)
    q, k = rotate_qk(q, k, cos, sin, positions)
    q, k = q.contiguous(), k.contiguous()
    if kv_store is not None:
        _store_rows_torch(kv_store, k, v)
    return q, k, v


def qkv_epilogue_triton(
    qkv, positions, cos, sin, *, num_heads, num_kv_heads, q_norm_weight=None,
    k_norm_weight=None, eps=1e-6, kv_store=None, tile_h=None,
):  # fmt: skip
    """Triton path of `qkv_epilogue`: one kernel; ``tile_h`` heads of one token per program
    (power of two; default ~1024 elements per program, one program per token when
    interpreting).

    A position outside ``[0, cos.shape[0])`` yields NaN q/k rows for that token (the kernel
    does not read outside the tables; checking on the host would cost a device sync).
    ``kv_store``: the same kernel also writes the k / v rows into the paged caches.
    ``qkv`` may be a `SplitSums` (the kernel adds up its partials).
    """
    from kvplan.models._fused_kernels import qkv_epilogue_kernel

    dtype = qkv.dtype
    parts = stride_part = 0
    if isinstance(qkv, SplitSums):  # the fp32 rows of the first partial; the kernel adds the rest
        parts, stride_part, qkv = qkv.sums.shape[0], qkv.sums.stride(0), qkv.sums[0]
    t = qkv.shape[0]
    d = _head_dim(qkv, num_heads, num_kv_heads)
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv must have a unit last-dim stride, got strides {qkv.stride()}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {list(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != d or table.dtype != dtype:
            raise ValueError(
                f"{name} must be [P, {d}] {dtype}, got {list(table.shape)} {table.dtype}"
            )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    qk_norm = q_norm_weight is not None
    if qk_norm:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w.shape != (d,) or w.dtype != dtype:
                raise TypeError(f"{name} must be [{d}] {dtype}, got {list(w.shape)} {w.dtype}")
    quant_kw = {}
    if kv_store is not None:
        layout = _check_kv_store(kv_store, t, num_kv_heads, d, qkv.device)
        k_cache, v_cache, slots = kv_store[:3]
        if layout is None:
            blocks, bs = k_cache.shape[:2]
            store = (slots, k_cache, v_cache, blocks * bs, k_cache.stride(0), k_cache.stride(1),
                     0, 0)  # fmt: skip
        else:
            from kvplan import quant
            from kvplan.ops._quant_triton import SF_KIND
            from kvplan.ops.cache_geometry import cache_bytes

            geo = cache_bytes(k_cache, layout)[1]
            bs = geo.block_size
            store = (slots, k_cache, v_cache, geo.num_slots, geo.block_stride, geo.v_stride,
                     geo.s_block_off, geo.s_stride)  # fmt: skip
            hw = not triton_interpreting()
            fp32_sf = layout.sf_format == "fp32"
            quant_kw = dict(
                QUANT=_FUSED_QUANT[layout.quantized_dtype], GS=layout.elements_per_sf,
                QMAX=float(quant.QMAX[layout.quantized_dtype]), SF=SF_KIND[layout.sf_format],
                SB=4 if fp32_sf else 1, HW=hw, FAST_DIV=hw and fp32_sf,
                SEARCH=layout.scale_search,
            )  # fmt: skip
    new = dict(dtype=dtype, device=qkv.device)
    q = torch.empty(t, num_heads, d, **new)
    k = torch.empty(t, num_kv_heads, d, **new)
    v = torch.empty(t, num_kv_heads, d, **new)
    heads = num_heads + 2 * num_kv_heads
    tile_d = triton_next_pow2(d)
    # ~1024 elements per program on the GPU; one program per token in the interpreter
    if tile_h is None:
        tile_h = triton_next_pow2(heads)
        if not triton_interpreting():
            tile_h = min(tile_h, max(1, 1024 // tile_d))
            if quant_kw.get("SEARCH"):
                # searched scales: K heads and V heads in programs of their own (the search of
                # a program runs over all its rows; sm_90 at llama-1b's heads: 16 heads a
                # program 128 registers a thread, 8 heads 70)
                tile_h = min(tile_h, _pow2_divisor(num_heads, num_kv_heads))
    if t > 0:
        w_q = q_norm_weight.contiguous() if qk_norm else q
        w_k = k_norm_weight.contiguous() if qk_norm else q
        if kv_store is None:
            store = (positions, q, q, 0, 0, 0, 0, 0)  # unused without STORE
        qkv_epilogue_kernel[(t, triton_cdiv(heads, tile_h))](
            qkv, positions, cos.contiguous(), sin.contiguous(), w_q, w_k, q, k, v,
            qkv.stride(0), cos.shape[0], eps, 1.0 / d, *store, stride_part,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, QK_NORM=qk_norm,
            TILE_H=tile_h, TILE_D=tile_d, STORE=kv_store is not None,
            BLOCK_SIZE=bs if kv_store is not None else 1, **quant_kw, PARTS=parts, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return q, k, v


# --- silu_and_mul ---------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor, *, fused: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` = ``[gate | up]``; returns ``[T, I]``.

    Rounding as torch: ``silu`` rounded to the dtype, then the product rounded.
    """
    if _fused(gate_up, fused):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)


def _inter(gate_up: torch.Tensor) -> int:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {list(gate_up.shape)}")
    return gate_up.shape[1] // 2


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch path of `silu_and_mul`."""
    gate, up = gate_up.split(_inter(gate_up), dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(gate_up: torch.Tensor, *, tile: int | None = None) -> torch.Tensor:
    """Triton path of `silu_and_mul`: grid ``(T, cdiv(I, tile))`` (``tile`` a power of two;
    default 1024, or all of I up to 8192 when interpreting)."""
    from kvplan.models._fused_kernels import silu_and_mul_kernel

    inter = _inter(gate_up)
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must have a unit last-dim stride, got {gate_up.stride()}")
    t = gate_up.shape[0]
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    interp = triton_interpreting()
    tile = tile or min(triton_next_pow2(inter), 8192 if interp else 1024)
    if t > 0:
        silu_and_mul_kernel[(t, triton_cdiv(inter, tile))](
            gate_up, out, inter, gate_up.stride(0), TILE=tile, EXACT=not interp, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out
