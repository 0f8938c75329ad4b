"""convert_kv_index: reference == torch == Triton, in place and with out=."""

import numpy as np
import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops import convert_kv_index
from kvplan.ops.convert_kv_index import (
    _convert_kv_index_kernel,
    convert_kv_index_ref,
    convert_kv_index_torch,
    convert_kv_index_triton,
)
from kvplan.ops.swa_index import index_tiles

# Triton paths run on the GPU when there is one, else in the interpreter (tests/conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dev(fn):
    return TRITON_DEVICE if fn.__name__.endswith("_triton") else torch.device("cpu")


def random_case(rng, rows, k, block_size, max_blocks=6):
    tables = rng.integers(0, 1000, size=(rows, max_blocks))
    topk = rng.integers(0, max_blocks * block_size, size=(rows, k))
    topk[rng.random((rows, k)) < 0.2] = -1
    ctx = rng.integers(0, k + 3, size=rows)
    # positions past the context may hold garbage the op must not read
    past = np.arange(k)[None, :] >= ctx[:, None]
    topk[past] = rng.integers(-50, 10**6, size=int(past.sum()))
    return (
        torch.tensor(topk, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
    )


def test_docstring_example():
    topk = torch.tensor([[5, 0, -1, 6]], dtype=torch.int32)
    bt = torch.tensor([[7, 2]], dtype=torch.int32)
    res = convert_kv_index(topk, bt, torch.tensor([3], dtype=torch.int32), 4)
    assert res is topk  # in place
    assert topk.tolist() == [[9, 28, -1, -1]]


@pytest.mark.parametrize("rows, k, block_size", [(1, 1, 1), (9, 17, 4), (5, 1500, 16), (3, 8, 33)])
def test_matches_reference_in_place(rows, k, block_size):
    rng = np.random.default_rng(rows * k + block_size)
    topk, bt, ctx = random_case(rng, rows, k, block_size)
    want = convert_kv_index_ref(topk, bt, ctx, block_size)
    for fn in (convert_kv_index_torch, convert_kv_index_triton):
        d = dev(fn)
        t = topk.to(d, copy=True)
        assert fn(t, bt.to(d), ctx.to(d), block_size) is t
        assert torch.equal(t.cpu(), want)


@pytest.mark.parametrize(
    "fn", [convert_kv_index_torch, convert_kv_index_triton], ids=["torch", "triton"]
)
def test_out_and_strided(fn):
    rng = np.random.default_rng(11)
    topk, bt, ctx = random_case(rng, 4, 6, 8)
    want = convert_kv_index_ref(topk, bt, ctx, 8)
    d = dev(fn)
    wide = torch.zeros(4, 10, dtype=torch.int32, device=d)
    wide[:, 2:8] = topk.to(d)
    view = wide[:, 2:8]  # row stride 10
    bt_big = torch.cat([bt, torch.full((2, bt.shape[1]), -5, dtype=torch.int32)])  # extra rows
    buf = torch.full((6, 6), 3, dtype=torch.int32, device=d)
    res = fn(view, bt_big.to(d), ctx.to(d), 8, out=buf)
    assert res.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:4].cpu(), want)
    assert (buf[4:] == 3).all()
    assert torch.equal(view.cpu(), topk)  # input untouched when out is given
    empty = torch.zeros(0, 6, dtype=torch.int32, device=d)
    assert fn(empty, bt.to(d), torch.zeros(0, dtype=torch.int32, device=d), 8).shape == (0, 6)


def test_errors():
    topk = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    bt = torch.tensor([[4, 5]], dtype=torch.int32)
    ctx = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(TypeError, match="topk_idxs"):
        convert_kv_index(topk.long(), bt, ctx, 2)
    with pytest.raises(TypeError, match="block_tables"):
        convert_kv_index(topk, bt.long(), ctx, 2)
    with pytest.raises(ValueError, match="context_lens"):
        convert_kv_index(topk, bt, ctx[:0], 2)
    with pytest.raises(ValueError, match="block_tables has 1 rows"):
        convert_kv_index(torch.zeros(2, 3, dtype=torch.int32), bt, ctx.repeat(2), 2)
    with pytest.raises(ValueError, match="block_size"):
        convert_kv_index(topk, bt, ctx, 0)
    with pytest.raises(ValueError, match=r"topk_idxs\[0, 1\] = 2"):
        convert_kv_index(topk, bt, ctx, 1)  # index 3 outside [-1, 2)
    with pytest.raises(ValueError, match=r"topk_idxs\[0, 0\] = -4"):
        convert_kv_index(torch.tensor([[-4]], dtype=torch.int32), bt, ctx[:1], 2)
    with pytest.raises(ValueError, match="block id -1"):
        convert_kv_index(topk.clone(), torch.tensor([[4, -1]], dtype=torch.int32), ctx, 2)
    with pytest.raises(ValueError, match="int32"):
        convert_kv_index(topk.clone(), torch.tensor([[2**30, 0]], dtype=torch.int32), ctx, 4)
    with pytest.raises(ValueError, match="context_lens holds -1"):
        convert_kv_index(topk, bt, torch.tensor([-1], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="context_lens"):
        convert_kv_index(topk, bt, ctx.to("meta"), 2)
    assert topk.tolist() == [[1, 2, 3]]  # rejected calls leave the input unchanged
    # the bad index sits past the context length: not converted, not checked
    short = torch.tensor([[1, 0, 3]], dtype=torch.int32)
    ok = convert_kv_index(short, bt, torch.tensor([2], dtype=torch.int32), 1)
    assert ok.tolist() == [[5, 4, -1]]


@pytest.mark.parametrize(
    "fn", [convert_kv_index_torch, convert_kv_index_triton], ids=["torch", "triton"]
)
def test_nothing_to_convert_with_empty_table(fn):
    d = dev(fn)
    topk = torch.tensor([[-1, -1], [7, 8]], dtype=torch.int32, device=d)  # row 1: past context
    ctx = torch.tensor([2, 0], dtype=torch.int32, device=d)
    got = fn(topk, torch.zeros(2, 0, dtype=torch.int32, device=d), ctx, 4)
    assert got.tolist() == [[-1, -1], [-1, -1]]


@pytest.mark.parametrize("rows, k", [(32768, 512), (3, 2048)])
def test_kernel_compiles_for_sm90(rows, k):
    tile_r, tile_c = index_tiles(rows, k)
    compile_sm90(_convert_kv_index_kernel, TILE_R=tile_r, TILE_C=tile_c)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, block_size", [(1, 1, 1), (4099, 2048, 16), (7, 5000, 64)])
def test_gpu_bit_exact(rows, k, block_size):
    rng = np.random.default_rng(rows + k)
    topk, bt, ctx = random_case(rng, rows, k, block_size, max_blocks=400)
    want = convert_kv_index_torch(topk.clone(), bt, ctx, block_size)
    t = topk.cuda()
    convert_kv_index(t, bt.cuda(), ctx.cuda(), block_size)
    assert torch.equal(t.cpu(), want)


@pytest.mark.gpu
def test_gpu_cuda_graph_in_place():
    rng = np.random.default_rng(10)
    topk, bt, ctx = random_case(rng, 32, 256, 16, max_blocks=40)
    t, bt_gpu, ctx_gpu = topk.cuda(), bt.cuda(), ctx.cuda()
    convert_kv_index(t.clone(), bt_gpu, ctx_gpu, 16, check=False)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        convert_kv_index(t, bt_gpu, ctx_gpu, 16, check=False)
    new_topk, new_bt, new_ctx = random_case(rng, 32, 256, 16, max_blocks=40)
    t.copy_(new_topk)
    bt_gpu.copy_(new_bt)
    ctx_gpu.copy_(new_ctx)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), convert_kv_index_ref(new_topk, new_bt, new_ctx, 16))
