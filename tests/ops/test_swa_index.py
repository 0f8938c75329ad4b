"""expand_swa_index / expand_swa_index_decode: reference == torch == Triton (interpreter, GPU)."""

import numpy as np
import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops import expand_swa_index, expand_swa_index_decode
from kvplan.ops.swa_index import (
    _expand_swa_decode_kernel,
    _expand_swa_index_kernel,
    expand_swa_index_decode_ref,
    expand_swa_index_decode_torch,
    expand_swa_index_decode_triton,
    expand_swa_index_ref,
    expand_swa_index_torch,
    expand_swa_index_triton,
    index_tiles,
)


def random_pivots(rng, rows, window):
    p1 = rng.integers(0, window + 1, size=rows)
    p3 = np.array([rng.integers(0, window - a + 1) for a in p1])
    p0 = rng.integers(0, 10_000, size=rows)
    p2 = rng.integers(0, 10_000, size=rows)
    return torch.tensor(np.stack([p0, p1, p2, p3], axis=1), dtype=torch.int32)


def random_offset_len(rng, rows, window, ring, num_states=5):
    state = rng.integers(0, num_states, size=rows)
    first = rng.integers(0, ring, size=rows)
    length = rng.integers(0, min(window, ring) + 1, size=rows)
    return torch.tensor(np.stack([state * ring + first, length], axis=1), dtype=torch.int32)


# Triton paths run on the GPU when there is one, else in the interpreter (tests/conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dev(fn):
    return TRITON_DEVICE if fn.__name__.endswith("_triton") else torch.device("cpu")


def test_docstring_examples():
    piv = torch.tensor([[10, 2, 40, 3]], dtype=torch.int32)
    assert expand_swa_index(piv, 6).tolist() == [[10, 11, 40, 41, 42, -1]]
    ol = torch.tensor([[3 * 8 + 6, 4]], dtype=torch.int32)
    assert expand_swa_index_decode(ol, 4, 8).tolist() == [[30, 31, 24, 25]]


# (rows, window): one program; several programs along both axes (TILE_C = 1024, TILE_R = 4)
SHAPES = [(1, 1), (13, 7), (9, 1500)]


@pytest.mark.parametrize("rows, window", SHAPES)
def test_expand_swa_index_matches_reference(rows, window):
    rng = np.random.default_rng(rows * 1000 + window)
    piv = random_pivots(rng, rows, window)
    want = expand_swa_index_ref(piv, window)
    assert torch.equal(expand_swa_index_torch(piv, window), want)
    assert torch.equal(expand_swa_index_triton(piv.to(TRITON_DEVICE), window).cpu(), want)


@pytest.mark.parametrize("rows, window, ring", [(1, 1, 1), (13, 7, 9), (9, 1500, 1500)])
def test_expand_swa_index_decode_matches_reference(rows, window, ring):
    rng = np.random.default_rng(rows * 1000 + window)
    ol = random_offset_len(rng, rows, window, ring)
    want = expand_swa_index_decode_ref(ol, window, ring)
    assert torch.equal(expand_swa_index_decode_torch(ol, window, ring), want)
    got = expand_swa_index_decode_triton(ol.to(TRITON_DEVICE), window, ring)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("window, ring", [(4, 4), (4, 6), (8, 8)])
def test_decode_window_holds_the_last_positions(window, ring):
    """Ring slot of position p is state * ring + p % ring; the window of a query at p must be
    exactly positions max(0, p - W + 1) .. p, oldest first (planning's offset_len formula)."""
    state, rows, positions = 2, [], range(0, 3 * ring)
    for p in positions:
        length = min(p + 1, window)
        rows.append([state * ring + (p - length + 1) % ring, length])
    ol = torch.tensor(rows, dtype=torch.int32)
    for fn in (expand_swa_index_decode_torch, expand_swa_index_decode_triton):
        got = fn(ol.to(dev(fn)), window, ring)
        for p, row in zip(positions, got.tolist(), strict=True):
            visible = list(range(max(0, p - window + 1), p + 1))
            want = [state * ring + q % ring for q in visible]
            assert row == want + [-1] * (window - len(visible))


@pytest.mark.parametrize(
    "fn", [expand_swa_index_torch, expand_swa_index_triton], ids=["torch", "triton"]
)
def test_out_writes_leading_rows_only(fn):
    rng = np.random.default_rng(0)
    piv = random_pivots(rng, 5, 12)
    buf = torch.full((8, 12), 77, dtype=torch.int32, device=dev(fn))
    res = fn(piv.to(dev(fn)), 12, out=buf)
    assert res.data_ptr() == buf.data_ptr() and res.shape == (5, 12)
    assert torch.equal(buf[:5].cpu(), expand_swa_index_ref(piv, 12))
    assert (buf[5:] == 77).all()


@pytest.mark.parametrize(
    "fn", [expand_swa_index_decode_torch, expand_swa_index_decode_triton], ids=["torch", "triton"]
)
def test_decode_out_and_empty(fn):
    ol = random_offset_len(np.random.default_rng(1), 3, 6, 8)
    buf = torch.full((4, 6), 55, dtype=torch.int32, device=dev(fn))
    fn(ol.to(dev(fn)), 6, 8, out=buf)
    assert torch.equal(buf[:3].cpu(), expand_swa_index_decode_ref(ol, 6, 8))
    assert (buf[3] == 55).all()
    empty = fn(torch.zeros(0, 2, dtype=torch.int32, device=dev(fn)), 6, 8, out=buf)
    assert empty.shape == (0, 6) and (buf[3] == 55).all()


def test_empty_pivots():
    assert expand_swa_index(torch.zeros(0, 4, dtype=torch.int32), 5).shape == (0, 5)
    assert expand_swa_index_triton(torch.zeros(0, 4, dtype=torch.int32), 5).shape == (0, 5)


def test_strided_pivots_view():
    """A pivots view with a row stride larger than 4 (a slice of a wider buffer)."""
    rng = np.random.default_rng(3)
    wide = torch.zeros(6, 9, dtype=torch.int32)
    wide[:, 2:6] = random_pivots(rng, 6, 10)
    want = expand_swa_index_ref(wide[:, 2:6].contiguous(), 10)
    assert torch.equal(expand_swa_index_torch(wide[:, 2:6], 10), want)
    wide_dev = wide.to(TRITON_DEVICE)
    assert torch.equal(expand_swa_index_triton(wide_dev[:, 2:6], 10).cpu(), want)


def test_errors():
    piv = torch.tensor([[0, 2, 5, 1]], dtype=torch.int32)
    with pytest.raises(TypeError, match="pivots"):
        expand_swa_index(piv.long(), 4)
    with pytest.raises(ValueError, match="pivots"):
        expand_swa_index(piv[:, :3], 4)
    with pytest.raises(ValueError, match="window_size"):
        expand_swa_index(piv, 0)
    with pytest.raises(ValueError, match=r"pivots\[0\]"):
        expand_swa_index(piv, 2)  # P1 + P3 = 3 > 2
    with pytest.raises(ValueError, match=r"pivots\[1\]"):
        expand_swa_index(torch.tensor([[0, 1, 0, 0], [-3, 1, 0, 0]], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="out"):
        expand_swa_index(piv, 4, out=torch.empty(1, 5, dtype=torch.int32))
    with pytest.raises(TypeError, match="out"):
        expand_swa_index(piv, 4, out=torch.empty(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        expand_swa_index(piv, 4, out=torch.empty(1, 8, dtype=torch.int32)[:, ::2])
    with pytest.raises(ValueError, match="out"):
        expand_swa_index(piv, 4, out=torch.empty(1, 4, dtype=torch.int32, device="meta"))
    # check=False skips the value checks (hot path), shapes are still checked
    assert expand_swa_index(piv, 3, check=False).shape == (1, 3)
    ol = torch.tensor([[8, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"offset_len\[0\]"):
        expand_swa_index_decode(ol, 6, 4)  # length 5 > ring 4
    with pytest.raises(ValueError, match="ring_size"):
        expand_swa_index_decode(ol, 6, 0)
    with pytest.raises(ValueError, match=r"offset_len\[0\]"):
        expand_swa_index_decode(torch.tensor([[-1, 1]], dtype=torch.int32), 6, 8)
    with pytest.raises(ValueError, match="int32"):
        expand_swa_index_decode(torch.tensor([[2**31 - 2, 1]], dtype=torch.int32), 6, 8)


@pytest.mark.parametrize("rows, window", [(32768, 128), (7, 1024), (3, 4096)])
def test_kernels_compile_for_sm90(rows, window):
    tile_r, tile_c = index_tiles(rows, window)
    compile_sm90(_expand_swa_index_kernel, TILE_R=tile_r, TILE_C=tile_c)
    compile_sm90(_expand_swa_decode_kernel, TILE_R=tile_r, TILE_C=tile_c)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, window", [(1, 1), (513, 128), (4099, 1024), (37, 3000)])
def test_gpu_bit_exact(rows, window):
    rng = np.random.default_rng(rows + window)
    piv = random_pivots(rng, rows, window)
    want = expand_swa_index_torch(piv, window)
    assert torch.equal(expand_swa_index(piv.cuda(), window).cpu(), want)
    ring = window + 7
    ol = random_offset_len(rng, rows, window, ring, num_states=1000)
    want = expand_swa_index_decode_torch(ol, window, ring)
    assert torch.equal(expand_swa_index_decode(ol.cuda(), window, ring).cpu(), want)
    buf = torch.full((rows + 3, window), 9, dtype=torch.int32, device="cuda")
    expand_swa_index_decode(ol.cuda(), window, ring, out=buf)
    assert torch.equal(buf[:rows].cpu(), want) and (buf[rows:] == 9).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_new_inputs():
    """Captured once with check=False and out=, replayed after the inputs change in place."""
    rng = np.random.default_rng(8)
    window, ring, rows = 128, 160, 64
    piv = random_pivots(rng, rows, window).cuda()
    ol = random_offset_len(rng, rows, window, ring).cuda()
    out_p = torch.empty(rows + 8, window, dtype=torch.int32, device="cuda")
    out_d = torch.empty(rows + 8, window, dtype=torch.int32, device="cuda")
    expand_swa_index(piv, window, out=out_p, check=False)  # compile before capture
    expand_swa_index_decode(ol, window, ring, out=out_d, check=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_swa_index(piv, window, out=out_p, check=False)
        expand_swa_index_decode(ol, window, ring, out=out_d, check=False)
    new_piv, new_ol = random_pivots(rng, rows, window), random_offset_len(rng, rows, window, ring)
    piv.copy_(new_piv)
    ol.copy_(new_ol)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_p[:rows].cpu(), expand_swa_index_ref(new_piv, window))
    assert torch.equal(out_d[:rows].cpu(), expand_swa_index_decode_ref(new_ol, window, ring))
