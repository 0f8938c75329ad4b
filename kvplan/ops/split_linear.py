"""Few-row projections as split-K partial products (`split_linear`) that the kernel reading
the output next adds up (`SplitSums`): the llama norms and qkv epilogue
(`kvplan.models.fused`), the hyper-connections' residual update
(`kvplan.ops.hyper_connection`)."""

from __future__ import annotations

import torch

from kvplan._checks import check_tensor

__all__ = [
    "SPLIT_LINEAR_MIN_WEIGHT",
    "SPLIT_LINEAR_ROWS",
    "SplitSums",
    "linear_splits",
    "split_linear",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class SplitSums:
    """A linear layer's output left as ``S`` fp32 partial products over slices of its input
    width, for the kernel that reads it next to add up (`kvplan.models.fused`'s `rms_norm` and
    `qkv_epilogue`, `kvplan.ops.hyper_connection`'s residual update).

    ``sums [S, T, N]`` (fp32, unit last stride); the output it stands for is
    ``sums[0] + sums[1] + ... + sums[S-1]`` (in that order, in fp32) rounded to ``dtype``:
    `total`. `split_linear` makes them.
    """

    __slots__ = ("sums", "dtype")

    def __init__(self, sums: torch.Tensor, dtype: torch.dtype) -> None:
        check_tensor("sums", sums, dtype=torch.float32, ndim=3)
        if sums.shape[0] < 1 or sums.stride(2) != 1:
            raise ValueError(
                f"sums must be [S >= 1, T, N] with unit last stride, got shape "
                f"{list(sums.shape)} strides {sums.stride()}"
            )
        self.sums = sums
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of the output, ``[T, N]``."""
        return self.sums.shape[1:]

    def rows(self, index: torch.Tensor) -> SplitSums:
        """The partials of the output rows ``index`` (``[N]`` int64, as ``output[index]``)."""
        return SplitSums(self.sums[:, index], self.dtype)

    def total(self) -> torch.Tensor:
        """The output ``[T, N]`` in ``dtype``: the partials summed in order, then rounded."""
        acc = self.sums[0].clone()
        for part in self.sums[1:]:
            acc += part
        return acc.to(self.dtype)


def split_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> SplitSums:
    """``x @ weight.T`` as ``splits`` fp32 partial products over equal slices of ``K``.

    One batched GEMM on CUDA (``torch.bmm`` with fp32 output over strided views of ``x`` and
    ``weight``, no copies): split K gives a few-row GEMM more programs, and the consumer adds
    the partials in the kernel it launches anyway, instead of a reduction kernel of its own.
    Elsewhere the same partials in fp32 arithmetic (the reference).

    Args:
        x: ``[T, K]`` bf16/fp16/fp32, unit last stride.
        weight: ``[N, K]``, contiguous, the dtype of ``x``.
        splits: ``S >= 1`` dividing ``K``.
    """
    check_tensor("x", x, dtype=_FLOATS, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2, device=x.device)
    t, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous [N, {k}], got shape {list(weight.shape)} "
            f"strides {weight.stride()}"
        )
    if not isinstance(splits, int) or splits < 1 or k % splits:
        raise ValueError(f"splits must be an int >= 1 dividing K = {k}, got {splits!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    kp = k // splits
    xs = x.as_strided((splits, t, kp), (kp, x.stride(0), 1))
    ws = weight.view(n, splits, kp).permute(1, 2, 0)  # [S, K/S, N], column-major slices
    if x.is_cuda and x.dtype != torch.float32:
        sums = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:
        sums = torch.bmm(xs.float(), ws.float())
    return SplitSums(sums, x.dtype)


SPLIT_LINEAR_ROWS = (32, 128)
"""`linear_splits` splits only GEMMs with this many rows (inclusive): llama-1b's o and down
projections at 2 splits measured faster from 32 to 128 rows and slower at 16 (o) and 256 (H100,
`bench/bench_split_linear.py`; bench/RESULTS.md, session 50)."""
SPLIT_LINEAR_MIN_WEIGHT = 1 << 22
"""... and only weights of at least this many elements (llama-1b's o, 2,048 x 2,048, is the
smallest measured; smaller GEMMs are mostly a kernel's fixed cost, which a split adds to)."""


def linear_splits(setting: int, rows: int, k: int, n: int) -> int:
    """The K splits for a ``rows x K`` input to an ``N x K`` weight under a model's
    ``setting`` (its split count, 0 = never): ``setting`` for rows within
    `SPLIT_LINEAR_ROWS` and ``N * K >= SPLIT_LINEAR_MIN_WEIGHT`` when it divides ``K``, else 0
    (the plain GEMM)."""
    low, high = SPLIT_LINEAR_ROWS
    if (setting and low <= rows <= high and n * k >= SPLIT_LINEAR_MIN_WEIGHT
            and k % setting == 0):  # fmt: skip
        return setting
    return 0
