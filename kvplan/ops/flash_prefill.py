"""Causal varlen prefill over a step's own new K/V rows with torch's flash attention.

When a prefill sequence has no cached history (``kv_len == q_len``), its keys are exactly the
K/V rows the step just computed, contiguous in the step's ``k`` / ``v`` tensors; attention
over them needs no page table, and torch's varlen flash kernel
(``torch.nn.attention.varlen.varlen_attn``) computes it directly::

    q  [T, H, D]    rows cu[b] : cu[b + 1] = sequence b's queries, positions 0 .. q_len_b - 1
    k  [T, Hkv, D]  the same rows' keys (v likewise); query i of b sees keys 0 .. i of b
                    (or the last W of them: ``sliding_window``)

What each prefill path supports (the caller, ``kvplan.backends.fresh_prefill``, tries SDPA,
then flash, then the paged kernel):

===============  ========================  ========================  ========================
                 SDPA (``sdpa_prefill``)   flash (this module)       Triton paged kernel
===============  ========================  ========================  ========================
keys             the step's new rows       the step's new rows       any cached prefix
calls            one per run of equal-     one                       one
                 length sequences
device / dtype   CUDA (CPU: switch=1),     CUDA, bf16 / fp16         CUDA or CPU, bf16 /
                 bf16 / fp16 / fp32                                  fp16 / fp32
cache            unquantized, same dtype   unquantized, same dtype   also fp8 / fp4
head_dim         multiple of 8, <= 256     multiple of 8, <= 256     power of two, 16 .. 256
GQA              H % Hkv == 0              H % Hkv == 0 (native)     H % Hkv == 0
sliding window   no (unless >= every       when ``varlen_attn``      yes
                 sequence's length)        takes ``window_size``
soft-cap, sinks  no                        no                        no (not in the contract)
===============  ========================  ========================  ========================

Switch: ``KVPLAN_PREFILL_FLASH=0`` turns the flash path off (default on where supported).
Availability is probed on first use per (device, dtype, head_dim, grouped, windowed) key: a
torch without ``varlen_attn``, or one whose kernel raises ``RuntimeError`` /
``NotImplementedError`` (an unsupported GPU, say) on that first call, marks the key
unsupported and the caller falls back to the Triton kernel; once a key has run, later errors
propagate. The probe results are the module's only state (a cache of facts about the
installed torch and GPU).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import torch

ENV_SWITCH = "KVPLAN_PREFILL_FLASH"
FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

# probe key -> True (ran) / False (failed at first use)
_probed: dict[tuple, bool] = {}


class VarlenApi(NamedTuple):
    """The installed ``varlen_attn`` and how it spells causality."""

    fn: Callable[..., Any]
    has_window: bool  # takes ``window_size=(left, right)`` (else ``is_causal``)
    has_enable_gqa: bool  # takes ``enable_gqa`` (else GQA passes through unchecked)


@lru_cache(maxsize=1)
def varlen_api() -> VarlenApi | None:
    """``torch.nn.attention.varlen.varlen_attn`` with its keyword set, or None if missing."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    has_window = "window_size" in params
    if not has_window and "is_causal" not in params:
        return None
    return VarlenApi(varlen_attn, has_window, "enable_gqa" in params)


def flash_prefill_enabled() -> bool:
    """The ``KVPLAN_PREFILL_FLASH`` switch: on unless set to ``0`` (read on every call)."""
    value = os.environ.get(ENV_SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def rows_unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
    quantized_cache: bool, dtypes: tuple[torch.dtype, ...],
) -> str | None:  # fmt: skip
    """What the fused prefill paths (this module's, `kvplan.ops.sdpa_prefill`) share: an
    unquantized cache of the queries' dtype (one of ``dtypes``), ``head_dim`` a multiple of 8
    up to ``MAX_HEAD_DIM``, query heads a multiple of the KV heads; the reason, or None."""
    if quantized_cache:
        return "quantized cache"
    if q.dtype not in dtypes:
        return f"dtype {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype == cache_dtype):
        return f"dtypes differ (q {q.dtype}, k {k.dtype}, v {v.dtype}, cache {cache_dtype})"
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}"
    if q.shape[1] % k.shape[1]:
        return f"heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}"
    return None


def flash_prefill_unsupported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
    quantized_cache: bool,
    sliding_window: int | None,
    max_q_len: int,
    api: VarlenApi | None = None,
    device_type: str | None = None,
) -> str | None:
    """Why :func:`flash_prefill` cannot serve these inputs, or None when it can.

    Host facts only (dtypes, shapes, the switch, the installed API); no device work.
    ``api`` and ``device_type`` default to the installed ``varlen_api()`` and ``q``'s device
    (tests pass them to check the decision without a GPU).
    """
    if not flash_prefill_enabled():
        return f"{ENV_SWITCH}=0"
    if (device_type or q.device.type) != "cuda":
        return "not a CUDA tensor"
    why = rows_unsupported(q, k, v, cache_dtype, quantized_cache, FLASH_DTYPES)
    if why is not None:
        return why
    api = varlen_api() if api is None else api
    if api is None:
        return "torch has no varlen_attn"
    if sliding_window is not None and sliding_window < max_q_len and not api.has_window:
        return "sliding window needs varlen_attn(window_size=...)"
    return None


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_q_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Causal varlen attention of ``q`` over its own rows' ``k`` / ``v``.

    Args:
        q: ``[T, H, D]`` CUDA bf16/fp16; k, v: ``[T, Hkv, D]``, same dtype, ``H % Hkv == 0``.
        cu_seqlens: int32 ``[B + 1]`` device, 0 .. T: sequence b owns rows
            ``cu_seqlens[b] : cu_seqlens[b + 1]`` of q, k and v alike.
        max_q_len: host bound on every sequence's length.
        scale: softmax scale. sliding_window: W (query p sees keys ``max(0, p - W + 1) .. p``
            of its sequence) or None.

    Returns a new ``[T, H, D]`` tensor, or None when this (device, dtype, head_dim, GQA,
    window) case failed at its first use (then never tried again; see the module docstring).
    Call :func:`flash_prefill_unsupported` first: this function assumes it returned None.
    """
    api = varlen_api()
    assert api is not None, "flash_prefill called without varlen_attn (check first)"
    windowed = sliding_window is not None and sliding_window < max_q_len
    grouped = q.shape[1] != k.shape[1]
    key = (q.device, q.dtype, q.shape[-1], grouped, windowed)
    state = _probed.get(key)
    if state is False:
        return None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    kwargs: dict[str, Any] = {"scale": float(scale)}
    if api.has_window:
        kwargs["window_size"] = (sliding_window - 1, 0) if windowed else (-1, 0)
    else:
        kwargs["is_causal"] = True
    if grouped and api.has_enable_gqa:
        kwargs["enable_gqa"] = True
    if state is None:
        try:
            res = api.fn(q, k, v, cu_seqlens, cu_seqlens, max_q_len, max_q_len, **kwargs)
        except (RuntimeError, NotImplementedError):
            _probed[key] = False
            return None
        _probed[key] = True
        return res
    return api.fn(q, k, v, cu_seqlens, cu_seqlens, max_q_len, max_q_len, **kwargs)
