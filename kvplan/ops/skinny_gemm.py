"""``y = x @ w^T (+ b)`` for a decode step's few rows (``M <= SKINNY_MAX_ROWS``), split over K.

A decode step multiplies 1-64 rows by each weight matrix, so the GEMM is a pass over the
weights; what limits it is how many SMs read them. For the small projections (a 2,048 x 3,072
qkv, a 2,048 x 2,048 o_proj) cuBLAS's tiles give a few dozen CTAs and reach ~40% of the copy
bandwidth on the H200 (bench/RESULTS.md). This op cuts N into ``block_n`` columns and K into
``splits`` ranges, so about ``PROGRAMS_PER_SM`` programs per SM stream the weights, each
multiplying all rows at once (one ``tl.dot`` per K tile, the rows padded to 16), then sums the
splits' fp32 partials in split order (a second launch; none with one split). Deterministic:
the same bits on every run for a given plan.

    y = skinny_linear(x, w, b)             # x [M, K], w [N, K], b [N] or None -> [M, N]
    y = linear(layer, x, fused=True)       # the models' call: skinny when enabled, else layer(x)

``linear`` (the Llama projections) and DeepSeek-V4's ``LinearGroup`` GEMMs take the skinny path
(`skinny_or_none`) when the rows are at most ``SKINNY_MAX_ROWS``, the ops run on Triton (CUDA,
or ``KVPLAN_FORCE_TRITON=1``) and the switch ``KVPLAN_SKINNY_GEMM`` is ``1`` (off by default
until the H200 sweep ``bench/bench_skinny_gemm.py`` shows where it beats cuBLAS). The torch
path (``F.linear``) is the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from kvplan._checks import check_tensor
from kvplan.ops._dispatch import triton_interpreting, use_triton
from kvplan.ops.cache_geometry import triton_cdiv, triton_next_pow2

__all__ = [
    "SkinnyTiles",
    "linear",
    "skinny_enabled",
    "skinny_linear",
    "skinny_or_none",
    "skinny_plan",
]

ENV_SWITCH = "KVPLAN_SKINNY_GEMM"
SKINNY_MAX_ROWS = 64
PROGRAMS_PER_SM = 2
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch of `skinny_linear`: ``block_n`` output columns and ``block_k`` reduction columns
    per program step (powers of two >= 16), ``splits`` K ranges (None: chosen by
    `skinny_plan` for about ``PROGRAMS_PER_SM`` programs per SM), warps, pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.splits is not None and (
            isinstance(self.splits, bool) or not isinstance(self.splits, int) or self.splits < 1
        ):
            raise ValueError(f"splits must be a positive int or None, got {self.splits!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int):
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


_INTERPRET_TILES = SkinnyTiles(16, 32, None, 4, 1)


def skinny_plan(n: int, k: int, num_sms: int, tiles: SkinnyTiles | None = None) -> tuple:
    """(tiles, splits, K tiles per split) for ``[*, k] @ [n, k]^T``: ``tiles.splits`` if set,
    else enough splits for ``PROGRAMS_PER_SM * num_sms`` programs, each split at least two K
    tiles long; splits that would start past K are dropped."""
    tiles = tiles or (_INTERPRET_TILES if triton_interpreting() else SkinnyTiles())
    k_tiles = triton_cdiv(k, tiles.block_k)
    splits = tiles.splits
    if splits is None:
        n_tiles = triton_cdiv(n, tiles.block_n)
        splits = max(1, min(PROGRAMS_PER_SM * num_sms // max(n_tiles, 1), k_tiles // 2))
    per_split = triton_cdiv(k_tiles, min(splits, k_tiles))
    return tiles, triton_cdiv(k_tiles, per_split), per_split


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    tiles: SkinnyTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ weight[N, K]^T (+ bias [N])`` -> ``[M, N]`` in ``x``'s dtype, for ``1 <= M <=
    SKINNY_MAX_ROWS`` (fp32 accumulation, one rounding). ``tiles`` overrides the launch
    (`SkinnyTiles`); the Triton kernels run on any device that ``use_triton`` allows."""
    from kvplan.ops._skinny_gemm_kernels import skinny_gemm_kernel, skinny_reduce_kernel

    check_tensor("x", x, dtype=_FLOATS, ndim=2)
    m, k = x.shape
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"x must have 1..{SKINNY_MAX_ROWS} rows, got {m}")
    check_tensor("weight", weight, dtype=x.dtype, ndim=2, device=x.device)
    if weight.shape[1] != k:
        raise ValueError(f"weight must have shape (N, {k}), got {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=(n,), device=x.device)
    if tiles is not None and not isinstance(tiles, SkinnyTiles):
        raise TypeError(f"tiles must be a SkinnyTiles, got {type(tiles).__name__}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    tiles, splits, per_split = skinny_plan(n, k, _num_sms(x.device), tiles)
    direct = splits == 1
    part = out if direct else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    half = x.dtype != torch.float32
    skinny_gemm_kernel[(triton_cdiv(n, tiles.block_n), splits)](
        x, weight, bias if bias is not None else out, part, m, n, k, x.stride(0),
        M_P=max(16, triton_next_pow2(m)), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        K_TILES=per_split, EVEN_K=k % (per_split * tiles.block_k) == 0, DIRECT=direct,
        HAS_BIAS=bias is not None, DOT_PRECISION="tf32" if half else "ieee",
        UPCAST=half and triton_interpreting(), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if not direct:
        block = 1024 if not triton_interpreting() else 256
        skinny_reduce_kernel[(triton_cdiv(m * n, block),)](
            part, bias if bias is not None else out, out, m, n, SPLITS=splits,
            HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out


def skinny_enabled() -> bool:
    """The ``KVPLAN_SKINNY_GEMM`` switch: ``1`` on; ``0`` or unset off (read on every call)."""
    value = os.environ.get(ENV_SWITCH, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0, 1 or unset, got {value!r}")
    return value == "1"


def skinny_or_none(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`skinny_linear` when the switch is on, ``x`` is 2-D with 1..``SKINNY_MAX_ROWS`` rows of
    ``weight``'s dtype and the ops run on Triton; else None (the caller runs its GEMM)."""
    if (
        x.dim() == 2
        and 1 <= x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype == weight.dtype
        and use_triton(x)
        and skinny_enabled()
    ):
        return skinny_linear(x, weight, bias)
    return None


def linear(layer: nn.Module, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """``layer(x)``, or `skinny_or_none`'s result with the layer's weight and bias when
    ``fused`` is set and ``layer`` is a plain ``nn.Linear``."""
    if fused and type(layer) is nn.Linear:
        y = skinny_or_none(x, layer.weight, layer.bias)
        if y is not None:
            return y
    return layer(x)
