"""expand_kv_ca_index (prefill and decode): reference == torch == Triton."""

import numpy as np
import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops import expand_kv_ca_index, expand_kv_ca_index_decode, kv_ca_index_width
from kvplan.ops.kv_ca_index import (
    _expand_kv_ca_kernel,
    expand_kv_ca_index_decode_ref,
    expand_kv_ca_index_decode_torch,
    expand_kv_ca_index_decode_triton,
    expand_kv_ca_index_ref,
    expand_kv_ca_index_torch,
    expand_kv_ca_index_triton,
)
from kvplan.ops.swa_index import index_tiles


def test_width():
    assert [kv_ca_index_width(n) for n in (0, 1, 128, 129, 131072)] == [128, 128, 128, 256, 131072]
    with pytest.raises(ValueError, match="max_len"):
        kv_ca_index_width(-1)


def test_docstring_example():
    ol = torch.tensor([[2, 4]], dtype=torch.int32)
    bt = torch.tensor([[7, 2]], dtype=torch.int32)
    got = expand_kv_ca_index_decode(ol, bt, block_size=8, ratio=2, max_len=8)
    assert got.shape == (1, 128)
    assert got[0, :6].tolist() == [30, 31, 8, 9, -1, -1] and (got[0, 4:] == -1).all()
    assert expand_kv_ca_index(ol, 8)[0, :6].tolist() == [2, 3, 4, 5, -1, -1]


# Triton paths run on the GPU when there is one, else in the interpreter (tests/conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dev(fn):
    return TRITON_DEVICE if fn.__name__.endswith("_triton") else torch.device("cpu")


def random_offset_len(rng, rows, max_len, max_offset=5000):
    offset = rng.integers(0, max_offset, size=rows)
    length = rng.integers(0, max_len + 1, size=rows)
    return torch.tensor(np.stack([offset, length], axis=1), dtype=torch.int32)


@pytest.mark.parametrize("rows, max_len", [(1, 1), (6, 100), (5, 1100)])
def test_prefill_matches_reference(rows, max_len):
    rng = np.random.default_rng(rows + max_len)
    ol = random_offset_len(rng, rows, max_len)
    want = expand_kv_ca_index_ref(ol, max_len)
    assert torch.equal(expand_kv_ca_index_torch(ol, max_len), want)
    assert torch.equal(expand_kv_ca_index_triton(ol.to(TRITON_DEVICE), max_len).cpu(), want)


def random_decode(rng, rows, max_len, tpb, flat):
    num_blocks = -(-max_len // tpb) + 1
    tables = rng.integers(0, 900, size=(rows, num_blocks))
    length = rng.integers(0, max_len + 1, size=rows)
    first = np.array([rng.integers(0, num_blocks * tpb - n + 1) for n in length])
    if flat:  # rows' tables end to end; offset = r * num_blocks * tpb + first position
        offset = np.arange(rows) * num_blocks * tpb + first
        bt = torch.tensor(tables.reshape(-1), dtype=torch.int32)
    else:
        offset = first
        bt = torch.tensor(tables, dtype=torch.int32)
    ol = torch.tensor(np.stack([offset, length], axis=1), dtype=torch.int32)
    return ol, bt


@pytest.mark.parametrize("flat", [False, True], ids=["per_row", "flat"])
@pytest.mark.parametrize(
    "rows, max_len, block_size, ratio", [(1, 1, 4, 4), (7, 90, 64, 4), (4, 1100, 133, 1)]
)
def test_decode_matches_reference(rows, max_len, block_size, ratio, flat):
    rng = np.random.default_rng(rows + max_len + flat)
    ol, bt = random_decode(rng, rows, max_len, block_size // ratio, flat)
    want = expand_kv_ca_index_decode_ref(ol, bt, block_size, ratio, max_len)
    assert torch.equal(expand_kv_ca_index_decode_torch(ol, bt, block_size, ratio, max_len), want)
    ol, bt = ol.to(TRITON_DEVICE), bt.to(TRITON_DEVICE)
    got = expand_kv_ca_index_decode_triton(ol, bt, block_size, ratio, max_len)
    assert torch.equal(got.cpu(), want)


def test_decode_slots_hold_the_positions():
    """Write position p's id at slot bt[p // tpb] * tpb + p % tpb; reading through the
    expanded index must give back positions offset .. offset + length - 1."""
    tpb, bt = 4, torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    store = torch.full((6 * tpb,), -7)
    for p in range(12):
        store[bt[0, p // tpb] * tpb + p % tpb] = p
    ol = torch.tensor([[0, 12], [3, 7]], dtype=torch.int32)
    for fn in (expand_kv_ca_index_decode_torch, expand_kv_ca_index_decode_triton):
        idx = fn(ol.to(dev(fn)), bt[[0, 0]].to(dev(fn)), 8, 2, 12).cpu()
        assert store[idx[0, :12].long()].tolist() == list(range(12))
        assert store[idx[1, :7].long()].tolist() == list(range(3, 10))
        assert (idx[1, 7:] == -1).all()


@pytest.mark.parametrize(
    "fn", [expand_kv_ca_index_torch, expand_kv_ca_index_triton], ids=["torch", "triton"]
)
def test_out_leading_rows(fn):
    ol = random_offset_len(np.random.default_rng(2), 3, 200)
    buf = torch.full((5, 256), 4, dtype=torch.int32, device=dev(fn))
    res = fn(ol.to(dev(fn)), 200, out=buf)
    assert res.data_ptr() == buf.data_ptr() and res.shape == (3, 256)
    assert torch.equal(buf[:3].cpu(), expand_kv_ca_index_ref(ol, 200)) and (buf[3:] == 4).all()


@pytest.mark.parametrize(
    "fn", [expand_kv_ca_index_decode_torch, expand_kv_ca_index_decode_triton],
    ids=["torch", "triton"],
)  # fmt: skip
def test_decode_out_leading_rows(fn):
    ol, bt = random_decode(np.random.default_rng(3), 3, 50, 8, False)
    want = expand_kv_ca_index_decode_ref(ol, bt, 16, 2, 50)
    ol, bt = ol.to(dev(fn)), bt.to(dev(fn))
    buf = torch.full((4, 128), 4, dtype=torch.int32, device=dev(fn))
    fn(ol, bt, 16, 2, 50, out=buf)
    assert torch.equal(buf[:3].cpu(), want)
    assert (buf[3:] == 4).all()
    assert fn(ol[:0], bt, 16, 2, 50, out=buf).shape == (0, 128)


def test_errors():
    ol = torch.tensor([[0, 5]], dtype=torch.int32)
    bt = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(TypeError, match="offset_len"):
        expand_kv_ca_index(ol.long(), 8)
    with pytest.raises(ValueError, match=r"offset_len\[0\]"):
        expand_kv_ca_index(ol, 4)  # length 5 > max_len 4
    with pytest.raises(ValueError, match=r"offset_len\[0\]"):
        expand_kv_ca_index(torch.tensor([[-1, 1]], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"offset_len\[0\]"):
        expand_kv_ca_index(torch.tensor([[2**31 - 2, 3]], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="out"):
        expand_kv_ca_index(ol, 8, out=torch.zeros(1, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="ratio"):
        expand_kv_ca_index_decode(ol, bt, 8, 3, 8)
    with pytest.raises(ValueError, match="block_size"):
        expand_kv_ca_index_decode(ol, bt, 0, 1, 8)
    with pytest.raises(TypeError, match="block_tables"):
        expand_kv_ca_index_decode(ol, bt.long(), 8, 2, 8)
    with pytest.raises(ValueError, match="block_tables"):
        expand_kv_ca_index_decode(ol, bt, 4, 2, 8)  # 5 positions need 3 blocks of 2
    with pytest.raises(ValueError, match="block_tables"):
        expand_kv_ca_index_decode(ol, torch.zeros(1, 2, 2, dtype=torch.int32), 8, 2, 8)
    with pytest.raises(ValueError, match="block id -1"):
        expand_kv_ca_index_decode(ol, torch.tensor([[1, -1]], dtype=torch.int32), 8, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        expand_kv_ca_index_decode(ol, torch.tensor([[2**30, 1]], dtype=torch.int32), 8, 2, 8)
    with pytest.raises(ValueError, match="block_tables"):
        expand_kv_ca_index_decode(ol, bt.to("meta"), 8, 2, 8)
    # flat table: only the entries read are checked
    flat = torch.tensor([5, -1, 6, 7], dtype=torch.int32)
    ok = expand_kv_ca_index_decode(torch.tensor([[0, 2], [4, 3]], dtype=torch.int32), flat, 4, 2, 4)
    assert ok[:, :3].tolist() == [[10, 11, -1], [12, 13, 14]]
    with pytest.raises(ValueError, match="block id -1"):
        expand_kv_ca_index_decode(torch.tensor([[0, 2], [3, 1]], dtype=torch.int32), flat, 4, 2, 4)
    # unused right part of a row may hold garbage
    ok = expand_kv_ca_index_decode(ol, torch.tensor([[1, 2, -9]], dtype=torch.int32), 8, 2, 8)
    assert ok[0, :5].tolist() == [4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    "fn", [expand_kv_ca_index_decode_torch, expand_kv_ca_index_decode_triton],
    ids=["torch", "triton"],
)  # fmt: skip
def test_decode_empty_rows_and_table(fn):
    """Rows of length 0 read no block entry, even from a table without columns."""
    ol = torch.tensor([[0, 0], [5, 0]], dtype=torch.int32, device=dev(fn))
    for shape in ((2, 0), (0,)):
        bt = torch.zeros(shape, dtype=torch.int32, device=dev(fn))
        assert (fn(ol, bt, 8, 2, 4) == -1).all()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rows, width", [(32768, 2048), (5, 128)])
def test_kernel_compiles_for_sm90(rows, width, paged):
    tile_r, tile_c = index_tiles(rows, width)
    compile_sm90(_expand_kv_ca_kernel, PAGED=paged, TILE_R=tile_r, TILE_C=tile_c)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, max_len", [(1, 1), (4099, 512), (17, 20000)])
@pytest.mark.parametrize("flat", [False, True], ids=["per_row", "flat"])
def test_gpu_bit_exact(rows, max_len, flat):
    rng = np.random.default_rng(rows + max_len)
    ol = random_offset_len(rng, rows, max_len)
    want = expand_kv_ca_index_torch(ol, max_len)
    assert torch.equal(expand_kv_ca_index(ol.cuda(), max_len).cpu(), want)
    ol, bt = random_decode(rng, rows, max_len, 16, flat)
    want = expand_kv_ca_index_decode_torch(ol, bt, 64, 4, max_len)
    got = expand_kv_ca_index_decode(ol.cuda(), bt.cuda(), 64, 4, max_len)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_new_inputs():
    rng = np.random.default_rng(9)
    rows, max_len = 48, 300
    ol, bt = random_decode(rng, rows, max_len, 16, True)
    ol, bt = ol.cuda(), bt.cuda()
    out = torch.empty(rows + 5, kv_ca_index_width(max_len), dtype=torch.int32, device="cuda")
    expand_kv_ca_index_decode(ol, bt, 64, 4, max_len, out=out, check=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_kv_ca_index_decode(ol, bt, 64, 4, max_len, out=out, check=False)
    new_ol, new_bt = random_decode(rng, rows, max_len, 16, True)
    ol.copy_(new_ol)
    bt.copy_(new_bt)
    graph.replay()
    torch.cuda.synchronize()
    want = expand_kv_ca_index_decode_ref(new_ol, new_bt, 64, 4, max_len)
    assert torch.equal(out[:rows].cpu(), want)
