"""topk_columns: torch path == Triton kernel (CPU interpreter, small rows and tiles) == a
per-row Python sort; GPU at the indexer's sizes, bit-exact against the torch path."""

from __future__ import annotations

import math

import pytest
import torch
from sm90_compile import compile_sm90

from kvplan.ops.index_scores import topk_columns as topk_from_index_scores
from kvplan.ops.sparse_attention import topk_columns as topk_from_sparse_attention
from kvplan.ops.topk import _topk_kernel, topk_columns, topk_columns_torch, topk_columns_triton

NAN, INF = float("nan"), float("inf")


def reference(scores, count, top_k, gather=None) -> list[list[int]]:
    """Per row: eligible (column < count, not NaN) sorted by (-score, column), the first
    top_k kept, their columns ascending (``gather``'s values instead when given)."""
    out = []
    for t, row in enumerate(scores.tolist()):
        cand = [(v, j) for j, v in enumerate(row[: max(int(count[t]), 0)]) if not math.isnan(v)]
        cand.sort(key=lambda p: (-p[0], p[1]))  # -0.0 == 0.0: a tie, the lower column first
        cols = sorted(j for _, j in cand[:top_k])
        if gather is not None:
            cols = [int(gather[t, j]) for j in cols]
        out.append(cols + [-1] * (top_k - len(cols)))
    return out


def make_case(kind: str, num_rows: int, width: int, seed: int):
    """fp32 ``[num_rows, width]`` scores and int32 counts of one flavour."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_rows, width, generator=gen) * 3.0
    if kind == "ties":  # few distinct values: the k-th is shared by many columns
        scores = torch.randint(-2, 3, (num_rows, width), generator=gen).float()
    elif kind == "special":  # -inf, +inf, NaN, +-0.0, subnormals, huge values
        pool = torch.tensor([-INF, INF, NAN, 0.0, -0.0, 1e-42, -1e-42, 3e38, -3e38, 1.0, -1.0])
        pick = torch.randint(0, pool.numel(), (num_rows, width), generator=gen)
        scores = torch.where(torch.rand(num_rows, width, generator=gen) < 0.6, pool[pick], scores)
    elif kind == "close":  # keys equal in their three high bytes: all four passes run
        low = torch.randint(0, 6, (num_rows, width), generator=gen, dtype=torch.int32)
        sign = torch.where(torch.rand(num_rows, 1, generator=gen) < 0.5, -1.0, 1.0)
        scores = (torch.tensor(1.5).view(torch.int32) + low).view(torch.float32) * sign
    elif kind == "neg_inf":  # fewer finite scores than top_k: -inf columns fill the rest
        scores = scores.masked_fill(torch.rand(num_rows, width, generator=gen) < 0.8, -INF)
    count = torch.randint(0, width + 1, (num_rows,), generator=gen, dtype=torch.int32)
    count[0] = width
    if num_rows > 1:
        count[1] = 0
    return scores, count


KINDS = ["random", "ties", "special", "close", "neg_inf"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width, top_k", [(300, 17), (64, 64), (40, 100), (1, 1)])
def test_torch_path_matches_reference(kind, width, top_k) -> None:
    scores, count = make_case(kind, 9, width, seed=width + top_k)
    assert topk_columns_torch(scores, count, top_k).tolist() == reference(scores, count, top_k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "width, top_k, tile", [(37, 8, 16), (70, 21, 32), (50, 50, 16), (20, 33, 16)]
)
def test_triton_interpreter_matches_reference(kind, width, top_k, tile) -> None:
    """Rows longer than a tile and not a multiple of it; top_k below, at and above W."""
    scores, count = make_case(kind, 4, width, seed=width)
    got = topk_columns_triton(scores, count, top_k, tile=tile)
    assert got.tolist() == reference(scores, count, top_k)


@pytest.mark.parametrize("bits", [3, 5, 6])
@pytest.mark.parametrize("kind", ["ties", "special", "close"])
def test_triton_interpreter_digit_widths(kind, bits) -> None:
    """Narrower digits: more passes, the last one shorter than the others."""
    scores, count = make_case(kind, 3, 45, seed=bits)
    got = topk_columns_triton(scores, count, 10, tile=16, bits=bits)
    assert got.tolist() == reference(scores, count, 10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width, top_k, tile, bits", [(70, 21, 32, 5), (37, 8, 16, 8),
                                                      (50, 50, 16, 3), (20, 33, 16, 6)])  # fmt: skip
def test_triton_interpreter_compacting_search(kind, width, top_k, tile, bits) -> None:
    """``compact``: the passes after the first read the first pass's bin from a workspace;
    the same winners as the reference for every flavour (ties: a bin of equal keys; special:
    NaN / infinities / signed zeros; close: every digit runs)."""
    scores, count = make_case(kind, 4, width, seed=width + bits)
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(0, 10**6, (4, width), generator=gen, dtype=torch.int32)
    got = topk_columns_triton(scores, count, top_k, tile=tile, bits=bits, compact=True)
    assert got.tolist() == reference(scores, count, top_k)
    got = topk_columns_triton(scores, count, top_k, gather=slots, tile=tile, bits=bits,
                              compact=True)  # fmt: skip
    assert got.tolist() == reference(scores, count, top_k, slots)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width, top_k, row, part, bits", [
    (70, 21, True, 0, 5), (37, 8, True, 0, 8), (64, 64, True, 0, 3), (20, 33, True, 0, 6),
    (1, 1, True, 0, 5), (70, 5, False, 16, 5), (70, 21, True, 16, 5), (100, 9, True, 32, 8),
    (33, 4, False, 32, 6), (0, 3, True, 16, 5), (68, 21, True, 0, 5), (34, 8, True, 0, 8),
    (17, 3, True, 0, 3), (68, 60, True, 0, 6),
])  # fmt: skip
def test_triton_interpreter_row_and_split_search(kind, width, top_k, row, part, bits) -> None:
    """``row``: the digit passes on the row's keys loaded once (ineligible columns as the
    no-key sentinel, which ``special``'s NaNs and ``count`` below the width exercise);
    ``part``: the top-k of every ``part`` columns, then of their winners (parts shorter than
    ``top_k``, a last part cut short, ties across parts); a row a little wider than a power
    of two (68, 34, 17) holds that power in registers and reads the rest per pass (``TAIL``,
    with counts on both sides of the power). The same winners as the reference, plain and
    gathered; the one-stage row writes its winners from the registers (``reg_write``) or
    from the row read again (both forms switched on here: ``tail``; off by default)."""
    scores, count = make_case(kind, 4, width, seed=width + bits + 1)
    gen = torch.Generator().manual_seed(8)
    slots = torch.randint(0, 10**6, (4, width), generator=gen, dtype=torch.int32)
    for reg_write in (True, False) if row and not part else (None,):
        cfg = dict(tile=16, bits=bits, row=row, part=part, reg_write=reg_write, tail=True)
        assert topk_columns_triton(scores, count, top_k, **cfg).tolist() == reference(
            scores, count, top_k
        )
        got = topk_columns_triton(scores, count, top_k, gather=slots, **cfg)
        assert got.tolist() == reference(scores, count, top_k, slots)


def test_row_and_part_argument_errors() -> None:
    scores, count = make_case("random", 2, 40, seed=0)
    for bad in (24, 8, -16):
        with pytest.raises(ValueError, match=f"part must be .* got {bad}"):
            topk_columns_triton(scores, count, 4, part=bad)
    wide = torch.zeros(1, 20000)
    with pytest.raises(ValueError, match="row holds at most 16384 columns, got 20000"):
        topk_columns_triton(wide, torch.zeros(1, dtype=torch.int32), 4, row=True)
    with pytest.raises(ValueError, match="compact"):
        topk_columns_triton(scores, count, 4, row=True, compact=True)


def test_explicit_form_replaces_the_plan(monkeypatch) -> None:
    """One search form given, the others left None are off (the plan is not mixed in): a
    many-row CUDA plan (compact) with ``row`` / ``part`` given, a few-row plan (row, part)
    with ``compact`` given."""
    import kvplan.ops.topk as tk

    seen = []
    monkeypatch.setattr(tk, "_launch", lambda *a, **kw: seen.append((kw["row"], kw["part"],
                                                                      kw["compact"])))  # fmt: skip
    monkeypatch.setattr(tk, "topk_plan", lambda *a: (False, 0, True))
    scores, count = make_case("random", 4, 64, seed=0)
    tk.topk_columns_triton(scores, count, 8)
    tk.topk_columns_triton(scores, count, 8, row=True)
    tk.topk_columns_triton(scores, count, 8, part=16)
    monkeypatch.setattr(tk, "topk_plan", lambda *a: (True, 16, False))
    tk.topk_columns_triton(scores, count, 8, compact=True)
    assert seen == [((0, 0), 0, True), ((64, 0), 0, False), ((0, 0), 16, False),
                    ((0, 0), 0, False), ((0, 0), 0, True)]  # fmt: skip


def test_row_plan() -> None:
    """``row_plan``: the power of two holding the row, or (``tail``) the one below it with
    the rest read per pass when that rest is at most 1/16 of the row; off by default."""
    import functools

    from kvplan.ops.topk import row_plan as plan

    assert plan(8192 + 40) == (16384, 0) and plan(68) == (128, 0)  # ROW_TAIL off
    row_plan = functools.partial(plan, tail=True)
    assert row_plan(8192) == (8192, 0)
    assert row_plan(8192 + 40) == (8192, 64)
    assert row_plan(8192 + 512) == (8192, 512)
    assert row_plan(8192 + 546) == (8192, 1024) and row_plan(8192 + 547) == (16384, 0)
    assert row_plan(16384 + 100) == (16384, 128)
    assert row_plan(68) == (64, 16) and row_plan(70) == (128, 0)
    assert row_plan(1) == (16, 0) and row_plan(17) == (16, 16)


def test_default_plan(monkeypatch) -> None:
    """``topk_plan``: few rows (up to half the SMs) hold the row in registers (a little
    wider than a power of two: that power plus a tail, with ``ROW_TAIL``), split into
    parts when wider than a register row holds (or wider than half of it, in parts of
    4,096 columns when a program each fits the SMs) and the parts' winners stay under half
    the row; more rows take the compacting search; no device: the plain search."""
    import kvplan.ops.topk as tk
    from kvplan.ops.topk import SPLIT_PART, topk_plan

    monkeypatch.setattr(tk, "ROW_TAIL", True)  # KVPLAN_TOPK_ROW_TAIL=1
    assert topk_plan(32, 8192 + 40, 512, 132) == (True, 0, False)  # 8,192 in registers + 40
    monkeypatch.setattr(tk, "ROW_TAIL", False)  # the default
    assert topk_plan(32, 32768, 512, 0) == (False, 0, False)
    assert topk_plan(32, 8192, 512, 132) == (True, 0, False)
    assert topk_plan(66, 16384, 512, 132) == (True, 0, False)  # 4 x 66 parts: too many
    assert topk_plan(32, 8192 + 40, 512, 132) == (True, 4096, False)  # 3 x 32 parts of 4,096
    assert topk_plan(32, 16384, 512, 132) == (True, 4096, False)
    assert topk_plan(32, 8192 + 40, 2048, 132) == (True, 0, False)  # the parts' winners: 6,144
    assert topk_plan(32, 32768, 512, 132) == (True, SPLIT_PART, False)  # 128 parts
    assert topk_plan(64, 32768, 512, 132) == (True, 2 * SPLIT_PART, False)  # 256 -> 128 parts
    assert topk_plan(40, 65536, 512, 132) == (True, 2 * SPLIT_PART, False)  # the widest part
    assert topk_plan(32, 32768, 4096, 132) == (False, 0, True)  # 4 x 4,096: half the row
    assert topk_plan(67, 8192, 512, 132) == (False, 0, True)
    assert topk_plan(256, 32768, 512, 132) == (False, 0, True)


def test_triton_interpreter_gather_and_row_stride() -> None:
    """Rows of a wider buffer (row stride 48 > W) and the column -> slot lookup."""
    buf, count = make_case("ties", 3, 48, seed=4)
    scores = buf[:, 5:35]  # [3, 30], stride (48, 1)
    count = count.clamp(max=30)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(0, 10**6, (3, 64), generator=gen, dtype=torch.int32)[:, :30]
    want = reference(scores, count, 12, slots)
    assert topk_columns_triton(scores, count, 12, gather=slots, tile=16).tolist() == want
    assert topk_columns_torch(scores, count, 12, gather=slots).tolist() == want
    assert any(-1 in row for row in want) and any(v > 30 for v in want[0])


def test_docstring_example_and_reexports(monkeypatch) -> None:
    scores = torch.tensor([[0.5, 3.0, -INF, 2.0, 9.0]])
    count = torch.tensor([4], dtype=torch.int32)
    gather = torch.tensor([[40, 41, 42, 43, 44]], dtype=torch.int32)
    assert topk_from_index_scores is topk_columns is topk_from_sparse_attention
    assert topk_columns(scores, count, 3).tolist() == [[0, 1, 3]]
    assert topk_columns(scores, count, 3, gather=gather).tolist() == [[40, 41, 43]]
    assert topk_columns(scores, count, 5).tolist() == [[0, 1, 2, 3, -1]]  # -inf fills in
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")  # the dispatch rule picks the kernel
    assert topk_columns(scores, count, 5).tolist() == [[0, 1, 2, 3, -1]]


def test_nan_never_wins_and_empty_rows() -> None:
    scores = torch.tensor([[NAN, 1.0, NAN, -INF], [NAN, NAN, NAN, NAN]])
    count = torch.tensor([4, 4], dtype=torch.int32)
    want = [[1, 3, -1], [-1, -1, -1]]
    assert topk_columns_torch(scores, count, 3).tolist() == want
    assert topk_columns_triton(scores, count, 3, tile=16).tolist() == want
    empty = torch.zeros(0, 5)
    none = torch.zeros(0, dtype=torch.int32)
    for fn in (topk_columns_torch, topk_columns_triton):
        assert fn(empty, none, 2).shape == (0, 2)
        assert (
            fn(torch.zeros(2, 0), torch.zeros(2, dtype=torch.int32), 2).tolist() == [[-1] * 2] * 2
        )


def test_unchecked_count_outside_range_clamps() -> None:
    """check=False: a count below 0 means no column, above W every column (both paths)."""
    scores, _ = make_case("random", 3, 20, seed=2)
    count = torch.tensor([-3, 25, 7], dtype=torch.int32)
    want = reference(scores, count.clamp(0, 20), 6)
    assert topk_columns_torch(scores, count, 6).tolist() == want
    assert topk_columns_triton(scores, count, 6, tile=16).tolist() == want


def test_validation() -> None:
    scores = torch.zeros(2, 6)
    count = torch.tensor([6, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="scores"):
        topk_columns(scores.double(), count, 2)
    with pytest.raises(ValueError, match="scores"):
        topk_columns(scores[0], count, 2)
    with pytest.raises(ValueError, match="column stride"):
        topk_columns(torch.zeros(6, 2).t(), count, 2)
    with pytest.raises(TypeError, match="count"):
        topk_columns(scores, count.long(), 2)
    with pytest.raises(ValueError, match="count"):
        topk_columns(scores, count[:1], 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="top_k"):
            topk_columns(scores, count, bad)
    with pytest.raises(ValueError, match="count holds 7"):
        topk_columns(scores, torch.tensor([7, 0], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="count holds -1"):
        topk_columns(scores, torch.tensor([-1, 0], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="gather"):
        topk_columns(scores, count, 2, gather=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(TypeError, match="gather"):
        topk_columns(scores, count, 2, gather=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="gather"):
        topk_columns(scores, count, 2, gather=torch.zeros(6, 2, dtype=torch.int32).t())
    with pytest.raises(ValueError, match="count is on meta"):
        topk_columns(scores, count.to("meta"), 2)


@pytest.mark.parametrize(
    "tile, bits, gather, compact, row, part",
    [(2048, 8, False, False, 0, 0), (2048, 8, True, False, 0, 0), (256, 5, True, False, 0, 0),
     (2048, 5, True, True, 0, 0), (4096, 8, True, True, 0, 0), (2048, 5, True, False, 8192, 0),
     (2048, 6, False, False, 16384, 0), (2048, 5, True, False, 8192, 8192),
     (2048, 5, False, False, 0, 8192), (2048, 5, True, False, 8192, -64),
     (2048, 5, True, False, 8192, -1)],
)  # fmt: skip
def test_kernel_compiles_for_sm90(tile, bits, gather, compact, row, part) -> None:
    """(``part`` < 0: no part, the registers' write, and a tail of ``-part`` columns when
    more than 1.)"""
    compile_sm90(
        _topk_kernel, signature={"scores_ptr": "*fp32", "values_ptr": "*fp32"}, TILE=tile,
        BITS=bits, GATHER=gather, COMPACT=compact, ROW=row, PART=max(part, 0),
        INTERPRET=False, TAIL=-part if part < -1 else 0, REG_WRITE=part < 0,
    )  # fmt: skip


@pytest.mark.parametrize("row, num_warps, tail", [(8192, 16, 0), (16384, 16, 0), (2048, 4, 0),
                                                  (8192, 16, 64)])  # fmt: skip
def test_row_in_registers_does_not_spill_on_sm90(row, num_warps, tail) -> None:
    """The in-register row at its default warps (`_row_warps`) fits sm_90's registers."""
    from sm90_compile import sm90_stats

    from kvplan.ops.topk import _row_warps

    assert _row_warps(row) == num_warps
    stats = sm90_stats(
        _topk_kernel, dict(TILE=2048, BITS=5, GATHER=True, COMPACT=False, ROW=row,
                           PART=0 if tail else row, INTERPRET=False, TAIL=tail,
                           REG_WRITE=bool(tail)),
        signature={"scores_ptr": "*fp32", "values_ptr": "*fp32"}, num_warps=num_warps,
    )  # fmt: skip
    assert stats.spill_bytes == 0, stats


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_rows, width",
    [(32, 8192), (32, 8232), (32, 32768), (4096, 8192), (4096, 32768), (4096, 2048)],
)
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
def test_gpu_bit_exact(num_rows, width, kind, monkeypatch) -> None:
    scores, count = make_case(kind, num_rows, width, seed=3)
    scores, count = scores.cuda(), count.cuda()
    gen = torch.Generator().manual_seed(5)
    slots = torch.randint(0, 2**30, (num_rows, width), generator=gen, dtype=torch.int32).cuda()
    for top_k in (512, 2048):
        want = topk_columns_torch(scores, count, top_k)
        assert torch.equal(topk_columns(scores, count, top_k), want)
        assert torch.equal(topk_columns_triton(scores, count, top_k, compact=True), want)
        if width <= 16384:
            import kvplan.ops.topk as tk

            for tail in (False, True):  # a row a little wider than a power of two: its tail
                monkeypatch.setattr(tk, "ROW_TAIL", tail)
                assert torch.equal(topk_columns(scores, count, top_k), want)  # the plan's form
                for reg_write in (True, False):
                    got = topk_columns_triton(scores, count, top_k, row=True,
                                              reg_write=reg_write, tail=tail)  # fmt: skip
                    assert torch.equal(got, want)
            monkeypatch.setattr(tk, "ROW_TAIL", False)
        for part in (2048, 8192):
            got = topk_columns_triton(scores, count, top_k, row=True, part=part)
            assert torch.equal(got, want)
            got = topk_columns_triton(scores, count, top_k, gather=slots, row=True, part=part)
            assert torch.equal(
                got, torch.where(want >= 0, slots.gather(1, want.long().clamp(0)), -1)
            )
        got = topk_columns(scores, count, top_k, gather=slots)
        assert torch.equal(got, torch.where(want >= 0, slots.gather(1, want.long().clamp(0)), -1))


@pytest.mark.gpu
def test_gpu_cuda_graph() -> None:
    scores, count = make_case("random", 32, 8192, seed=1)
    s_gpu, c_gpu = scores.cuda(), count.cuda()
    topk_columns(s_gpu, c_gpu, 512, check=False)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_columns(s_gpu, c_gpu, 512, check=False)
    new_scores, new_count = make_case("ties", 32, 8192, seed=2)
    s_gpu.copy_(new_scores)
    c_gpu.copy_(new_count)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), topk_columns_torch(new_scores, new_count, 512))
