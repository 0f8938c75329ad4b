"""argmax_rows: the Triton kernels (CPU interpreter, small rows and tiles; sm_90 compile) equal
torch's ``argmax(dim=-1)`` and a per-row Python scan, with ties, NaN, infinities, signed zeros
and strided rows; on CUDA at a decode step's sizes."""

from __future__ import annotations

import math

import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops.argmax import (
    _argmax_merge_kernel,
    _argmax_part_kernel,
    argmax_rows,
    argmax_rows_torch,
    argmax_rows_triton,
    argmax_splits,
)

NAN, INF = float("nan"), float("inf")


def python_argmax(x: torch.Tensor) -> list[int]:
    """Per row: the first NaN if any, else the first column of the largest value."""
    out = []
    for row in x.float().tolist():
        nans = [j for j, v in enumerate(row) if math.isnan(v)]
        if nans:
            out.append(nans[0])
            continue
        top = max(row)
        out.append(next(j for j, v in enumerate(row) if v == top))
    return out


def make_case(kind: str, rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(rows, width, generator=gen) * 4.0
    elif kind == "ties":  # the maximum repeated across parts of the row
        x = torch.randint(-3, 3, (rows, width), generator=gen).float()
    else:  # special values: NaN only in some rows, infinities, signed zeros
        pool = torch.tensor([-INF, INF, 0.0, -0.0, -1.0, 2.0, -3e38])
        x = pool[torch.randint(0, len(pool), (rows, width), generator=gen)]
        x[0] = -0.0
        x[0, 3:] = 0.0  # -0.0 ties +0.0: the first column wins
        x[1] = -INF  # all -inf: column 0
        x[2, width - 1] = NAN
        x[2, width // 2] = INF
        if rows > 3:
            x[3, 5] = NAN
            x[3, 7] = NAN
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_interpreter_equals_torch(kind, dtype, splits) -> None:
    x = make_case(kind, 5, 200, dtype, seed=splits)
    want = argmax_rows_torch(x)
    assert want.tolist() == python_argmax(x)
    got = argmax_rows_triton(x, splits=splits, tile=32)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()


def test_strided_rows_and_uneven_parts() -> None:
    """Rows of a wider buffer (row stride 300 > 250 columns); parts that do not divide the row
    (the last part partly masked); more splits than tiles (clamped)."""
    buf = make_case("ties", 4, 300, torch.bfloat16, seed=9)
    x = buf[:, 17:267]
    want = x.argmax(dim=-1).tolist()
    for splits in (3, 7, 50):
        assert argmax_rows_triton(x, splits=splits, tile=16).tolist() == want


def test_dispatch_and_errors() -> None:
    x = make_case("random", 3, 40, torch.float32, seed=1)
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert argmax_rows_triton(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(torch.zeros(4, 6).t())
    with pytest.raises(TypeError, match="x"):
        argmax_rows(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="splits"):
        argmax_rows_triton(x, splits=0)
    with pytest.raises(ValueError, match="tile"):
        argmax_rows_triton(x, tile=48)


def test_split_plan() -> None:
    # 64 decode rows of a 128,256-word vocabulary on 132 SMs: 9 parts (576 programs)
    assert argmax_splits(64, 128256, 2048, 132) == 9
    assert argmax_splits(1, 128256, 2048, 132) == 63  # one part a tile at most
    assert argmax_splits(4096, 49152, 2048, 132) == 1


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernels_compile_for_sm90(dtype) -> None:
    compile_sm90(_argmax_part_kernel, "*i32", {"x_ptr": dtype}, TILE=2048, INTERPRET=False)
    compile_sm90(_argmax_merge_kernel, "*i32", {"out_ptr": "*i64"}, S_P2=16, CHUNKS=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width", [(64, 128256), (32, 129280), (3, 49152), (300, 1000)])
def test_cuda_equals_torch(rows, width, dtype) -> None:
    for kind in ("random", "ties", "special"):
        x = make_case(kind, rows, width, dtype, seed=rows).cuda()
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), kind
