"""The hyper-connections' residual update fed a split-K projection's partials (`SplitSums`):
`hc_post` / `hc_post_pre` give, bit for bit, what they give on ``out.total()`` (the partials
added in order and rounded), on the Triton path (interpreter on CPU, the GPU when there is one;
the fused decode form, the two-kernel form above ``FUSED_MAX_ROWS`` and the row-tiled form)
and on the torch path; a DeepSeek-V4 attention block with its ``o_b_proj`` split returns such
partials, and the model's logits stay those of the unsplit projection within rounding."""

from __future__ import annotations

import pytest
import torch

from kvplan.ops import hyper_connection as hc
from kvplan.ops.hyper_connection import hc_post, hc_post_pre, hc_post_pre_triton, hc_post_triton
from kvplan.ops.split_linear import SplitSums, split_linear
from tests.ops.test_hyper_connection_fused import EPS, HC_EPS, TRITON_DEVICE
from tests.ops.test_hyper_connection_fused import _inputs as _block_inputs


def _inputs(seed, t, n, hidden, dtype, parts, device):
    """`test_hyper_connection_fused`'s block inputs with the block output as ``parts`` random
    fp32 partials: (s, post, comb, SplitSums out, next fn, base, scale)."""
    s, post, comb, _, fn, base, scale = _block_inputs(seed, t, n, hidden, dtype, device)
    gen = torch.Generator().manual_seed(seed + 1000)
    out = SplitSums(torch.randn(parts, t, hidden, generator=gen).to(device), dtype)
    return s, post, comb, out, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, n, hidden, parts", [(3, 4, 40, 2), (18, 2, 24, 3), (40, 4, 24, 2)])
def test_post_pre_reads_partials_as_their_total(t, n, hidden, parts, dtype, monkeypatch):
    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")  # `hc_post_pre` takes the Triton path
    s, post, comb, out, fn, base, scale = _inputs(t + parts, t, n, hidden, dtype, parts,
                                                  TRITON_DEVICE)  # fmt: skip
    kw = dict(iters=4, hc_eps=HC_EPS, eps=EPS)
    total = out.total()
    want = hc_post_pre_triton(s, post, comb, total, fn, base, scale, **kw)
    # the fused decode form, and `hc_post_pre`'s choice (two ops above FUSED_MAX_ROWS rows)
    for got in (hc_post_pre_triton(s, post, comb, out, fn, base, scale, **kw),
                hc_post_pre(s, post, comb, out, fn, base, scale, **kw)):  # fmt: skip
        for name, g, w in zip(("s", "post", "comb", "x"), got, want):
            assert torch.equal(g, w), name


@pytest.mark.parametrize("rows_tiled", [False, True])
def test_post_reads_partials_as_their_total(rows_tiled, monkeypatch):
    if rows_tiled:
        monkeypatch.setattr(hc, "ROW_TILED_MIN_ROWS", 2)
    s, post, comb, out, *_ = _inputs(5, 6, 3, 24, torch.bfloat16, 4, TRITON_DEVICE)
    want = hc_post_triton(s, post, comb, out.total())
    assert torch.equal(hc_post_triton(s, post, comb, out), want)
    # partials that are a strided view (rows of a larger output) are read correctly too
    wide = SplitSums(torch.cat([out.sums, out.sums], dim=2)[:, :, :24], out.dtype)
    assert torch.equal(hc_post_triton(s, post, comb, wide), want)


def test_torch_path_sums_then_rounds():
    s, post, comb, out, *_ = _inputs(9, 4, 2, 16, torch.bfloat16, 2, "cpu")
    want = hc_post(s, post, comb, out.total())
    assert torch.equal(hc_post(s, post, comb, out), want)
    # the partials' sum is not the sum of separately rounded partials: the total is used
    rounded = out.sums[0].to(torch.bfloat16) + out.sums[1].to(torch.bfloat16)
    assert not torch.equal(out.total(), rounded)


def test_bad_partials_are_named():
    s, post, comb, out, *_ = _inputs(2, 3, 2, 8, torch.bfloat16, 2, "cpu")
    with pytest.raises(ValueError, match="out.sums"):
        hc_post(s, post, comb, SplitSums(out.sums[:, :2], out.dtype))
    with pytest.raises(ValueError, match="out.dtype"):
        hc_post(s, post, comb, SplitSums(out.sums, torch.float16))


def test_split_linear_into_post_equals_the_linear_total():
    """The path a model takes: `split_linear` then `hc_post`; equal to `hc_post` of the
    rounded total, and within a bf16 rounding of `hc_post` of the plain GEMM's output."""
    gen = torch.Generator().manual_seed(11)
    t, n, hidden, k = 5, 2, 16, 64
    s, post, comb, _, *_ = _inputs(3, t, n, hidden, torch.bfloat16, 2, "cpu")
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(hidden, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    parts = split_linear(x, w, 2)
    got = hc_post(s, post, comb, parts)
    assert torch.equal(got, hc_post(s, post, comb, parts.total()))
    plain = hc_post(s, post, comb, torch.nn.functional.linear(x, w))
    torch.testing.assert_close(got, plain, atol=2**-5, rtol=2**-7)
