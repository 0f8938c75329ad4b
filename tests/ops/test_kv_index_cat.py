"""kv_index_cat: reference == torch == Triton (interpreter; bit-exact on the GPU)."""

import numpy as np
import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops import kv_index_cat
from kvplan.ops.kv_index_cat import (
    _kv_index_cat_kernel,
    kv_index_cat_ref,
    kv_index_cat_torch,
    kv_index_cat_triton,
)


def random_table(rng, rows, width, hi=5000):
    t = rng.integers(0, hi, size=(rows, width))
    t[rng.random((rows, width)) < 0.3] = -1
    return torch.tensor(t, dtype=torch.int32)


# Triton paths run on the GPU when there is one, else in the interpreter (tests/conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dev(fn):
    return TRITON_DEVICE if fn.__name__.endswith("_triton") else torch.device("cpu")


def test_docstring_example():
    swa = torch.tensor([[3, 4, -1]], dtype=torch.int32)
    ca = torch.tensor([[0, 2, -1, -1]], dtype=torch.int32)
    assert kv_index_cat(swa, ca, 10).tolist() == [[3, 4, -1, 10, 12, -1, -1]]


# (rows, Wl, Wr): one program; empty sides; several programs along both axes
SHAPES = [(1, 1, 1), (11, 5, 9), (7, 0, 6), (7, 6, 0), (9, 130, 1300)]


@pytest.mark.parametrize("rows, wl, wr", SHAPES)
def test_matches_reference(rows, wl, wr):
    rng = np.random.default_rng(rows * 7 + wl + wr)
    swa, ca = random_table(rng, rows, wl), random_table(rng, rows, wr)
    base = int(rng.integers(0, 10_000))
    want = kv_index_cat_ref(swa, ca, base)
    assert want.shape == (rows, wl + wr)
    assert torch.equal(kv_index_cat_torch(swa, ca, base), want)
    got = kv_index_cat_triton(swa.to(TRITON_DEVICE), ca.to(TRITON_DEVICE), base)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("fn", [kv_index_cat_torch, kv_index_cat_triton], ids=["torch", "triton"])
def test_out_and_strided_inputs(fn):
    rng = np.random.default_rng(5)
    big = random_table(rng, 6, 20)
    want = kv_index_cat_ref(big[:, 1:5], big[:, 8:19], 40)
    big = big.to(dev(fn))
    swa, ca = big[:, 1:5], big[:, 8:19]  # views with row stride 20
    buf = torch.full((9, 15), 123, dtype=torch.int32, device=dev(fn))
    res = fn(swa, ca, 40, out=buf)
    assert res.data_ptr() == buf.data_ptr() and res.shape == (6, 15)
    assert torch.equal(buf[:6].cpu(), want)
    assert (buf[6:] == 123).all()
    assert fn(swa[:0], ca[:0], 40, out=buf).shape == (0, 15)
    assert (buf[6:] == 123).all()


def test_errors():
    swa = torch.zeros(2, 3, dtype=torch.int32)
    ca = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="swa_index"):
        kv_index_cat(swa.long(), ca, 0)
    with pytest.raises(TypeError, match="ca_index"):
        kv_index_cat(swa, ca.float(), 0)
    with pytest.raises(ValueError, match="rows"):
        kv_index_cat(swa, ca[:1], 0)
    with pytest.raises(ValueError, match="ca_base"):
        kv_index_cat(swa, ca, -1)
    with pytest.raises(ValueError, match="ca_base"):
        kv_index_cat(swa, ca, 2**31)
    with pytest.raises(ValueError, match="ca_index holds -2"):
        kv_index_cat(swa, torch.full((2, 4), -2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="overflows int32"):
        kv_index_cat(swa, torch.full((2, 4), 2**31 - 5, dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="ca_index"):
        kv_index_cat(swa, torch.zeros(2, 4, dtype=torch.int32, device="meta"), 0)
    with pytest.raises(ValueError, match="out"):
        kv_index_cat(swa, ca, 0, out=torch.zeros(2, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="column stride"):
        kv_index_cat(torch.zeros(2, 6, dtype=torch.int32)[:, ::2], ca, 0)


@pytest.mark.parametrize("tile_r, tile_cl, tile_cr", [(8, 128, 512), (4, 1024, 128), (32, 1, 128)])
def test_kernel_compiles_for_sm90(tile_r, tile_cl, tile_cr):
    compile_sm90(_kv_index_cat_kernel, TILE_R=tile_r, TILE_CL=tile_cl, TILE_CR=tile_cr)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, wl, wr", [(1, 1, 1), (4099, 128, 512), (33, 1024, 3000), (5, 0, 7)])
def test_gpu_bit_exact(rows, wl, wr):
    rng = np.random.default_rng(rows + wl + wr)
    swa, ca = random_table(rng, rows, wl), random_table(rng, rows, wr)
    want = kv_index_cat_torch(swa, ca, 12345)
    got = kv_index_cat(swa.cuda(), ca.cuda(), 12345)
    assert torch.equal(got.cpu(), want)
    buf = torch.full((rows + 2, wl + wr), 7, dtype=torch.int32, device="cuda")
    kv_index_cat(swa.cuda(), ca.cuda(), 12345, out=buf)
    assert torch.equal(buf[:rows].cpu(), want) and (buf[rows:] == 7).all()
