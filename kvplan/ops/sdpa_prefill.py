"""Causal prefill over a step's own new K/V rows with torch's ``scaled_dot_product_attention``.

The fresh rows of a prefill segment (no cached history, ``kv_len == q_len``; see
``kvplan.ops.flash_prefill``) are packed sequence after sequence. A run of consecutive
sequences of one length L is a ``[B, L, H, D]`` block of rows, so its transposed view is the
``[B, H, L, D]`` input SDPA takes, with no copy; one SDPA call per such group, and the result
is copied back into the caller's output rows::

    cu_seqlens  0      4096    8192    12288   12300
    lengths     4096   4096    4096    12
    groups      |rows 0 .. 12287: B=3, L=4096   | rows 12288 .. 12299: B=1, L=12 |

GQA goes to SDPA natively (``enable_gqa=True``) when the installed torch takes that keyword,
else K/V are expanded with ``repeat_interleave``. SDPA picks its backend itself (torch's
default order) among the fused kernels; the unfused math backend, which materialises the
``[B, H, L, L]`` scores, is excluded. SDPA has no sliding window: a window shorter than the
longest sequence rules this path out (the caller falls back).

Switch: ``KVPLAN_PREFILL_SDPA``: ``0`` off, ``1`` on wherever supported (CPU included); unset
= on for CUDA tensors, off for CPU ones. Many short groups are left to the varlen path (one
launch for all): this path applies when there are at most :data:`MAX_GROUPS` groups or the
groups average at least :data:`MIN_GROUP_TOKENS` tokens. Like the flash path, availability is
probed on the first call per (device, dtype, head_dim, grouped) key: native GQA first, then
expanded K/V, else the key is marked unsupported and :func:`sdpa_prefill` returns None. The
probe results are the module's only state.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvplan.ops.flash_prefill import rows_unsupported

ENV_SWITCH = "KVPLAN_PREFILL_SDPA"
SDPA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GROUPS = 4  # this many groups or fewer: SDPA whatever their size
MIN_GROUP_TOKENS = 512  # more groups than MAX_GROUPS: SDPA when they average this many tokens
FUSED_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
]

# probe key -> "native" (enable_gqa) / "expand" (repeat_interleave) / False (failed)
_probed: dict[tuple, str | bool] = {}


class SeqGroup(NamedTuple):
    """``num_seqs`` consecutive sequences of ``seq_len`` tokens from token row ``start``."""

    start: int
    num_seqs: int
    seq_len: int

    @property
    def end(self) -> int:
        return self.start + self.num_seqs * self.seq_len


def equal_length_groups(cu_seqlens: np.ndarray) -> list[SeqGroup]:
    """Maximal runs of consecutive equal-length sequences of a host ``cu_seqlens`` ``[n + 1]``
    (any integer dtype, ``cu_seqlens[0]`` may be nonzero); empty sequences are dropped.

    >>> equal_length_groups(np.array([0, 4, 8, 11, 14, 15]))
    [SeqGroup(start=0, num_seqs=2, seq_len=4), SeqGroup(start=8, num_seqs=2, seq_len=3), \
SeqGroup(start=14, num_seqs=1, seq_len=1)]
    """
    cu = np.asarray(cu_seqlens).tolist()  # a plain loop: n is small, numpy calls cost more
    runs: list[list[int]] = []  # [start, num_seqs, seq_len]
    for start, end in zip(cu[:-1], cu[1:]):
        n = end - start
        if n <= 0:
            continue
        if runs and runs[-1][2] == n:  # contiguous: empty sequences between add no rows
            runs[-1][1] += 1
        else:
            runs.append([start, 1, n])
    return [SeqGroup(*r) for r in runs]


@lru_cache(maxsize=1)
def sdpa_takes_enable_gqa() -> bool:
    """Whether the installed ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (checked
    once with a tiny CPU call: the builtin has no inspectable signature)."""
    x = torch.zeros(1, 2, 1, 8)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def sdpa_prefill_enabled(device_type: str) -> bool:
    """The ``KVPLAN_PREFILL_SDPA`` switch for tensors on ``device_type`` (read on every call)."""
    value = os.environ.get(ENV_SWITCH, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0, 1 or unset, got {value!r}")
    if value == "":
        return device_type == "cuda"
    return value == "1"


def sdpa_prefill_unsupported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: list[SeqGroup],
    *,
    cache_dtype: torch.dtype,
    quantized_cache: bool,
    sliding_window: int | None,
    device_type: str | None = None,
) -> str | None:
    """Why :func:`sdpa_prefill` cannot serve these inputs, or None when it can.

    Host facts only (dtypes, shapes, the switch, the groups); no device work. ``device_type``
    defaults to ``q``'s (tests pass it to check the decision without a GPU).
    """
    device_type = device_type or q.device.type
    if not sdpa_prefill_enabled(device_type):
        return f"{ENV_SWITCH} off for {device_type}"
    if device_type not in ("cuda", "cpu"):
        return f"device {device_type}"
    why = rows_unsupported(q, k, v, cache_dtype, quantized_cache, SDPA_DTYPES)
    if why is not None:
        return why
    if not groups:
        return "no rows"
    max_len = max(g.seq_len for g in groups)
    if sliding_window is not None and sliding_window < max_len:
        return f"sliding window {sliding_window} < {max_len} tokens"
    num_tokens = groups[-1].end - groups[0].start
    if len(groups) > MAX_GROUPS and num_tokens < MIN_GROUP_TOKENS * len(groups):
        return f"{len(groups)} length groups over {num_tokens} tokens"
    return None


def _attend_groups(q, k, v, groups, out, scale: float, native: bool) -> None:
    """One SDPA call per group, each written into its rows of ``out``."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    grouped = num_heads != num_kv_heads
    with sdpa_kernel(FUSED_BACKENDS):
        for g in groups:
            rows = slice(g.start, g.end)
            shape = (g.num_seqs, g.seq_len)
            qg = q[rows].unflatten(0, shape).transpose(1, 2)  # [B, H, L, D]
            kg = k[rows].unflatten(0, shape).transpose(1, 2)  # [B, Hkv, L, D]
            vg = v[rows].unflatten(0, shape).transpose(1, 2)
            kw = {}
            if grouped and native:
                kw["enable_gqa"] = True
            elif grouped:
                rep = num_heads // num_kv_heads
                kg, vg = kg.repeat_interleave(rep, 1), vg.repeat_interleave(rep, 1)
            res = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, **kw)
            out[rows].unflatten(0, shape).copy_(res.transpose(1, 2))  # [B, L, H, D]


def sdpa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: list[SeqGroup],
    *,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Causal attention of each sequence's queries over its own rows' keys, group by group.

    Args:
        q: ``[T, H, D]`` bf16/fp16/fp32 (CUDA or CPU); k, v: ``[T, Hkv, D]``, same dtype and
            device, ``H % Hkv == 0``. Any strides whose last dim is 1 (rows of a fused QKV
            projection are fine): groups are views of these rows.
        groups: :func:`equal_length_groups` of the rows' host ``cu_seqlens`` (rows outside
            every group are not read, nor written).
        scale: softmax scale.
        out: ``[T, H, D]`` destination in q's dtype (a new tensor when None).

    Returns ``out`` with every group's rows written (query i of a sequence sees its keys
    0 .. i), or None when this (device, dtype, head_dim, GQA) case failed at its first use
    (then never tried again; see the module docstring; ``out``'s rows may hold partial
    results, for the caller's fallback to overwrite). Call
    :func:`sdpa_prefill_unsupported` first: this function assumes it returned None.
    """
    grouped = q.shape[1] != k.shape[1]
    key = (q.device, q.dtype, q.shape[-1], grouped)
    state = _probed.get(key)
    if state is False:
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if state is not None:
        _attend_groups(q, k, v, groups, out, scale, state == "native")
        return out
    modes = ["native", "expand"] if grouped and sdpa_takes_enable_gqa() else ["expand"]
    for mode in modes:
        try:
            _attend_groups(q, k, v, groups, out, scale, mode == "native")
        except (RuntimeError, NotImplementedError):
            continue
        _probed[key] = mode
        return out
    _probed[key] = False
    return None
