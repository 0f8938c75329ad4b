"""`kvplan.ops.l2_prefetch`: the launch's arithmetic, the setting, the sm_90 code, and on a GPU
that a prefetched step computes the same values."""

import pytest
import torch
from sm90_compile import sm90_stats

from kvplan.ops import l2_prefetch as lp


def test_chunks_cover_the_aligned_span():
    t = torch.empty(3 * lp.CHUNK * lp.LANES // 2 - 8, dtype=torch.bfloat16)  # 2 B a value
    base, nbytes, programs = lp.l2_prefetch_chunks(t)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 2
    assert base % 16 == 0 and start <= base < start + 16
    assert nbytes % 16 == 0 and end - 16 < base + nbytes <= end
    assert programs == -(-nbytes // (lp.CHUNK * lp.LANES)) == 3
    # a view that starts off a 16-byte boundary: the first whole unit after it
    v = t[3:]
    vb, vn, _ = lp.l2_prefetch_chunks(v)
    assert vb == -(-v.data_ptr() // 16) * 16 and vb + vn <= v.data_ptr() + v.numel() * 2
    assert lp.l2_prefetch_chunks(torch.empty(0))[1:] == (0, 0)
    with pytest.raises(ValueError, match="contiguous"):
        lp.l2_prefetch_chunks(torch.empty(4, 4).t())


def test_setting_parses_and_names_a_bad_word(monkeypatch):
    assert lp.l2_prefetch_setting("") == (frozenset(), False)
    assert lp.l2_prefetch_setting("0") == (frozenset(), False)
    assert lp.l2_prefetch_setting("o") == (frozenset({"o"}), False)
    assert lp.l2_prefetch_setting(" o , qkv,stream") == (frozenset({"o", "qkv"}), True)
    monkeypatch.setenv(lp.L2_PREFETCH_ENV, "qkv")
    assert lp.l2_prefetch_setting() == (frozenset({"qkv"}), False)
    with pytest.raises(ValueError, match=r"KVPLAN_L2_PREFETCH: unknown part 'down'"):
        lp.l2_prefetch_setting("o,down")


def test_off_cuda_it_does_nothing():
    w = torch.randn(64, 32)
    before = w.clone()
    assert not lp.prefetch_supported(w)
    lp.l2_prefetch(w)
    pf = lp.L2Prefetch(side_stream=True)
    pf.issue((w,))
    pf.join()
    assert torch.equal(w, before) and pf._stream is None


def test_kernel_compiles_for_sm90_with_the_bulk_prefetch():
    stats = sm90_stats(
        lp.l2_prefetch_kernel, {"CHUNK": lp.CHUNK, "LANES": lp.LANES},
        signature={"base": "i64", "nbytes": "i64"}, div16={"base", "nbytes"},
        num_warps=max(1, lp.LANES // 32),
    )  # fmt: skip
    assert stats.cp_async  # cp.async.bulk.prefetch.L2.global survived to the PTX
    assert stats.spill_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("side_stream", [False, True])
def test_gpu_prefetched_graph_equals_plain(side_stream):
    """A captured chain of GEMMs with each weight prefetched (inline or on a side stream)
    gives the same bits as without."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(4)]  # fmt: skip
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    pf = lp.L2Prefetch(side_stream=side_stream)

    def chain(prefetch):
        h = x
        for w in ws:
            if prefetch:
                pf.issue((w,))
                pf.join()
            h = torch.tanh(h @ w.t())[:, :1024].contiguous()
        return h

    want = chain(False)
    assert torch.equal(chain(True), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
