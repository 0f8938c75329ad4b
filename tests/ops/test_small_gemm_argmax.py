"""small_linear's fused greedy argmax (``argmax_out``): the kernel's per-tile best (key,
column) and `argmax_merge` (CPU interpreter, several tiles; sm_90 compile; CUDA at LM-head
shapes) give ``logits.argmax(-1)`` of the returned logits and a per-row Python scan, with ties
within and across tiles, the maximum in the last partial tile, values that tie only once
rounded to the output dtype, NaN, infinities and signed zeros; the logits are bitwise those of
the call without it; a bad ``argmax_out`` raises naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import compile_sm90, sm90_stats

from kvplan.ops import small_gemm as sg
from kvplan.ops.argmax import _argmax_merge_kernel, argmax_merge
from tests.ops.test_argmax import python_argmax

M, N, K = 5, 70, 32  # 16-column tiles: five programs, the last one 6 columns wide
PLAN = sg.small_gemm_plan(M, block_n=16, block_k=16)
BIG = {torch.bfloat16: 2.0**64, torch.float16: 256.0}  # BIG * BIG: fp32 inf / fp16 inf
TINY = {torch.bfloat16: 2.0**-70, torch.float16: 2.0**-14}  # TINY * TINY rounds to zero


def make_case(kind: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]``, ``w [N, K]`` of ``dtype`` whose product has the ``kind`` feature (small
    integers: every sum exact in fp32, ties everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (M, K), generator=gen).double()
    w = torch.randint(-2, 3, (N, K), generator=gen).double()
    if kind == "ties":  # rows 0, 1: the maximum at 3, 4 (one tile) and 19, 45, 67 (three more)
        x[:, 0], w[:, 0] = 0.0, 0.0
        x[:2, 0] = 10.0
        w[[3, 4, 19, 45, 67], 0] = 10.0
        w[[4, 19, 45, 67], 1:] = w[3, 1:]
    elif kind == "last_tile":  # the maximum in the partial last tile, tied at 66 and 69
        x[:, 0], w[:, 0] = 1.0, 0.0
        x[1, 0] = -1.0  # row 1 has its minimum there instead
        w[[66, 69], 0] = 200.0
        w[69, 1:] = w[66, 1:]
    elif kind == "rounding":  # columns 10 and 50 differ by less than half a step of the dtype
        x[:, 2:] = x[:, 2:].clamp(-1, 1)
        w[:, 2:] = w[:, 2:].clamp(-1, 1)
        x[:, :2], w[:, :2] = 1.0, 0.0
        w[[10, 50], 0] = 100.0
        w[50, 1] = 2.0**-3 if dtype == torch.bfloat16 else 2.0**-6
        w[50, 2:] = w[10, 2:]
    elif kind == "special":
        big, tiny = BIG[dtype], TINY[dtype]
        x[:, 2:6] = 0.0
        w[:, 2:6] = 0.0
        x[3, 2] = big  # row 3: +inf at 20 and 33 (tied), -inf at 5
        w[[20, 33], 2], w[5, 2] = big, -big
        x[1] = 0.0  # row 1: only (signed) zeros and negatives; column 0 holds -0.0
        x[1, 5] = -tiny
        w[:, 5] = torch.tensor([tiny, -tiny, 1.0])[torch.randint(0, 3, (N,), generator=gen)]
        w[0, 5] = tiny
        x[4, 3] = float("inf")  # row 4: +inf everywhere but NaN (inf * 0) at 40 and 60
        w[:, 3] = 1.0
        w[[40, 60], 3] = 0.0
    elif kind == "nan":  # NaN columns 40 and 60 in every row; row 4 NaN everywhere
        x[:, 3:5], w[:, 3:5] = 0.0, 0.0
        x[:, 3] = 1.0
        w[[40, 60], 3] = float("nan")
        x[4, 4] = float("inf")  # inf * 0
    return x.to(dtype), w.to(dtype)


def _run(x, w, plan=PLAN):
    plain = sg.small_linear_triton(x, w, plan)
    tokens = torch.full((x.shape[0],), -7, dtype=torch.int64)
    logits = sg.small_linear_triton(x, w, plan, argmax_out=tokens)
    # the option leaves the logits bitwise alone (NaN payloads and signed zeros included)
    assert torch.equal(logits.view(torch.int16), plain.view(torch.int16))
    return logits, tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["ties", "last_tile", "rounding", "special", "nan"])
def test_interpreter_fused_argmax_equals_argmax_of_the_logits(kind, dtype) -> None:
    x, w = make_case(kind, dtype, seed=len(kind))
    logits, tokens = _run(x, w)
    want = logits.argmax(dim=-1)
    assert tokens.tolist() == want.tolist() == python_argmax(logits)
    if kind == "ties":
        assert tokens[:2].tolist() == [3, 3]
        assert (logits[:2, [4, 19, 45, 67]] == logits[:2, 3:4]).all()
    elif kind == "last_tile":
        assert tokens.tolist() == [66, int(tokens[1]), 66, 66, 66] and tokens[1] != 66
    elif kind == "rounding":  # fp32 picks 50; the stored logits tie, and 10 comes first
        exact = (x.double() @ w.double().T).argmax(dim=-1)
        assert exact.tolist() == [50] * M and tokens.tolist() == [10] * M
    elif kind == "special":
        assert tokens[3] == 20 and torch.isinf(logits[3, 5]) and logits[3, 5] < 0
        assert tokens[1] == 0 and logits[1, 0] == 0 and torch.signbit(logits[1, 0])
        assert (logits[1] == 0).sum() > 1 and (~torch.signbit(logits[1][logits[1] == 0])).any()
        assert tokens[4] == 40 and torch.isinf(logits[4, 2]) and torch.isnan(logits[4, 60])
    else:
        assert tokens.tolist() == [40, 40, 40, 40, 0] and torch.isnan(logits[4]).all()


def test_uneven_k_and_one_row() -> None:
    """K not a multiple of the K step (masked loads) and a single token row."""
    x, w = make_case("ties", torch.bfloat16, seed=4)
    x, w = x[:, :24].contiguous(), w[:, :24].contiguous()
    logits, tokens = _run(x, w)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    logits, tokens = _run(x[2:3], w, sg.small_gemm_plan(1, block_n=16, block_k=16))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_merge_in_chunks() -> None:
    """`argmax_merge` over more parts than its tile (a loop of chunks) equals one chunk, and
    both give the first column of the best key (ties: the earlier part)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-3, 3, (4, 41), generator=gen, dtype=torch.int32)
    keys[2] = 9  # every part tied: part 0's column
    cols = (torch.arange(41, dtype=torch.int32) * 16 + torch.randint(0, 16, (4, 41), generator=gen)
            ).to(torch.int32)  # fmt: skip
    want = [int(c[(k == k.max()).nonzero()[0, 0]]) for k, c in zip(keys, cols)]
    for tile in (16, 64):
        out = torch.empty(4, dtype=torch.int64)
        assert argmax_merge(keys, cols, out, tile=tile).tolist() == want
    with pytest.raises(ValueError, match="tile"):
        argmax_merge(keys, cols, out, tile=24)
    with pytest.raises(ValueError, match="cols"):
        argmax_merge(keys, cols[:, :3].contiguous(), out)


def test_torch_path_fills_argmax_out() -> None:
    """CPU tensors take ``F.linear``; ``argmax_out`` is then argmax_rows of its logits."""
    x, w = make_case("ties", torch.bfloat16, seed=6)
    assert not sg.small_linear_wanted(x, w)
    tokens = torch.empty(M, dtype=torch.int64)
    logits = sg.small_linear(x, w, argmax_out=tokens)
    assert torch.equal(logits, F.linear(x, w))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    x32, w32 = torch.randn(3, 8), torch.randn(50, 8)
    logits = sg.small_linear(x32, w32, argmax_out=tokens[:3])
    assert tokens[:3].tolist() == logits.argmax(-1).tolist()


def test_bad_argmax_out() -> None:
    x, w = make_case("ties", torch.bfloat16, seed=1)
    for call in (sg.small_linear, sg.small_linear_triton):
        with pytest.raises(TypeError, match="argmax_out must have dtype torch.int64"):
            call(x, w, argmax_out=torch.empty(M, dtype=torch.int32))
        with pytest.raises(ValueError, match="argmax_out must have shape \\(5,\\)"):
            call(x, w, argmax_out=torch.empty(M + 1, dtype=torch.int64))
        with pytest.raises(ValueError, match="argmax_out must be contiguous"):
            call(x, w, argmax_out=torch.empty(2 * M, dtype=torch.int64)[::2])
        with pytest.raises(ValueError, match="argmax_out must be on cpu"):
            call(x, w, argmax_out=torch.empty(M, dtype=torch.int64, device="meta"))
        with pytest.raises(ValueError, match="argmax_out: a weight of 0 rows"):
            call(x, w[:0], argmax_out=torch.empty(M, dtype=torch.int64))
        with pytest.raises(TypeError, match="argmax_out must be a torch.Tensor"):
            call(x, w, argmax_out=[0] * M)


def test_fused_kernel_compiles_for_sm90_without_spills() -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    consts = dict(BLOCK_M=64, BLOCK_N=sg.BLOCK_N, BLOCK_K=sg.BLOCK_K, K_STEPS=16, EVEN_K=True,
                  ARGMAX=True)  # fmt: skip
    stats = sm90_stats(sg.small_linear_kernel, consts, signature=sig, num_warps=sg.NUM_WARPS,
                       num_stages=sg.NUM_STAGES)  # fmt: skip
    assert stats.spill_bytes == 0 and stats.wgmma


@pytest.mark.parametrize("chunks", [1, 3])
def test_wide_merge_compiles_for_sm90(chunks) -> None:
    """The merge of the LM head's 1,002 tiles (128,256 / 128): 1,024 parts a chunk."""
    compile_sm90(_argmax_merge_kernel, "*i32", {"out_ptr": "*i64"}, S_P2=1024, CHUNKS=chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(64, 128256, 2048), (32, 129280, 2048), (5, 262144, 640)])
def test_cuda_fused_argmax_at_lm_head_shapes(m, n, k) -> None:
    """On the GPU: tokens equal torch's argmax of the returned logits (random rows, rows with
    the maximum tied in several tiles, NaN columns), the logits bitwise the plain call's, in
    a CUDA graph too."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    w[[1000, 77000, n - 1]] = w[5].clone()  # the same column four times: ties across tiles
    x[: m // 2] = w[5] * 4  # rows whose best column is 5 (and its copies)
    assert sg.small_linear_wanted(x, w)
    tokens = torch.empty(m, dtype=torch.int64, device="cuda")
    logits = sg.small_linear(x, w, argmax_out=tokens)
    assert torch.equal(logits, sg.small_linear(x, w))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert (tokens[: m // 2] == 5).all()
    w[[300, 90000], 7] = float("nan")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = sg.small_linear(x, w, argmax_out=tokens)
    tokens.zero_()
    g.replay()
    assert torch.equal(tokens, replayed.argmax(dim=-1)) and (tokens == 300).all()
