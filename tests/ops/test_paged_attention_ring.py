"""Paged attention with a recent-window ring (`RecentRing`): the newest keys of each sequence
come from an unquantized ring, older ones from the (quantized or plain) pages.

The reference is the per-query float64 ``paged_attention_ref`` over the dequantized pages in
which every position ``p >= lo[b]`` holds its ring row instead. Ring rows that no sequence
should read are NaN, so a kernel that reads one poisons its output; the ring's values differ
from the pages', so a kernel that ignores the ring misses the reference."""

from __future__ import annotations

import pytest
import torch

from kvplan.ops.paged_attention import (
    RecentRing,
    paged_attention_decode_torch,
    paged_attention_decode_triton,
    paged_attention_prefill_torch,
    paged_attention_prefill_triton,
)
from tests.ops.test_paged_attention import Case, assert_close, make_case
from tests.ops.test_paged_attention_quantized import quantized_case

SIZE = 16  # ring positions a sequence


def ring_case(case: Case, pages: Case, starts: list[int], slots: list[int], seed: int,
              bf16_pages: bool = False):  # fmt: skip
    """(the ring of ``case``'s sequences, the reference case: ``pages`` (float caches) with
    every ring position overwritten). ``starts[b]``: the first position sequence b wrote to
    the ring (a prefix-cache hit starts later); ``slots[b]``: its ring slot. ``bf16_pages``:
    the pages' values rounded to bf16 first (what the torch path reads from a quantized
    cache: ``quant.dequantize``)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = pages.k_cache.shape[2], pages.k_cache.shape[3]
    rows = (max(slots) + 1) * SIZE
    ring_k = torch.full((rows, hkv, d), float("nan"))
    ring_v = torch.full((rows, hkv, d), float("nan"))
    if bf16_pages:
        k_ref, v_ref = pages.k_cache.bfloat16().float(), pages.v_cache.bfloat16().float()
    else:
        k_ref, v_ref = pages.k_cache.clone(), pages.v_cache.clone()
    bs = k_ref.shape[1]
    lo = []
    for b, kv_len in enumerate(case.kv_lens.tolist()):
        first = max(kv_len - SIZE, starts[b])
        lo.append(first)
        for p in range(first, kv_len):
            row = slots[b] * SIZE + p % SIZE
            ring_k[row] = torch.randn(hkv, d, generator=gen)
            ring_v[row] = torch.randn(hkv, d, generator=gen)
            block = int(case.page_ids[int(case.page_start[b]) + p // bs])
            k_ref[block, p % bs] = ring_k[row]
            v_ref[block, p % bs] = ring_v[row]
    base = torch.tensor([s * SIZE for s in slots], dtype=torch.int32)
    ring = RecentRing(ring_k.to(case.q.dtype), ring_v.to(case.q.dtype), base,
                      torch.tensor(lo, dtype=torch.int32), SIZE)  # fmt: skip
    ref = Case(case.q, k_ref, v_ref, case.page_ids, case.page_start, case.cu_seqlens_q,
               case.kv_lens, case.scale, case.window)  # fmt: skip
    return ring, ref


CASES = [
    # (kind, seed, kv_lens, q_lens, starts, slots, block_size, window)
    ("fp8", 0, [1, 37, 70], [1, 5, 9], [0, 30, 0], [2, 0, 1], 8, None),
    ("fp8", 1, [20, 16, 45], [3, 16, 1], [0, 0, 44], [0, 1, 2], 16, 7),
    ("int8", 2, [33, 9], [4, 2], [0, 0], [1, 0], 4, None),
    ("fp4", 3, [50, 17], [6, 17], [40, 0], [0, 3], 8, None),
    ("plain", 4, [29, 64, 3], [2, 1, 3], [0, 10, 0], [0, 1, 2], 16, None),
    # one-token pages (KVPLAN_WINDOW_FRESH=rows: a fresh prompt's stored rows as the pages)
    ("plain", 6, [16, 9], [16, 9], [0, 0], [0, 1], 1, None),
]


def _case(kind, seed, kv_lens, q_lens, block_size, window):
    kw = dict(group=2, block_size=block_size, window=window, layout="offsets", head_dim=32)
    if kind == "plain":
        c = make_case(seed, kv_lens, q_lens, **kw)
        return c, (c.k_cache, c.v_cache), None, c
    return quantized_case(kind, seed, kv_lens, q_lens, **kw)


def _prefill(path, args, scale, window, q_lens, fmt, ring):
    """The torch path's or the Triton kernel's (16 x 16 tiles) prefill over ``args``."""
    if path == "torch":
        return paged_attention_prefill_torch(*args, scale=scale, sliding_window=window,
                                             kv_layout=fmt, ring=ring)  # fmt: skip
    return paged_attention_prefill_triton(
        *args, scale=scale, sliding_window=window, max_q_len=max(q_lens), tile_m=16, tile_n=16,
        kv_layout=fmt, ring=ring,
    )  # fmt: skip


@pytest.mark.parametrize("kind,seed,kv_lens,q_lens,starts,slots,block_size,window", CASES)
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_prefill_reads_the_ring(kind, seed, kv_lens, q_lens, starts, slots, block_size, window,
                                path):  # fmt: skip
    c, (k_raw, v_raw), fmt, dq = _case(kind, seed, kv_lens, q_lens, block_size, window)
    torch_path = path == "torch"
    ring, ref = ring_case(c, dq, starts, slots, seed, bf16_pages=torch_path and fmt is not None)
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens)
    got = _prefill(path, args, c.scale, window, q_lens, fmt, ring)
    assert_close(got, ref.ref(decode=False))
    without = paged_attention_prefill_torch(*args, scale=c.scale, sliding_window=window,
                                            kv_layout=fmt)  # fmt: skip
    assert (without - got).abs().max() > 1e-3  # the ring changed the result


@pytest.mark.parametrize("kind,seed,kv_lens,q_lens,starts,slots,block_size,window", CASES)
@pytest.mark.parametrize("splits,heads", [(1, 1), (3, 1), (2, 2)])
def test_decode_reads_the_ring(kind, seed, kv_lens, q_lens, starts, slots, block_size, window,
                               splits, heads):  # fmt: skip
    c, (k_raw, v_raw), fmt, dq = _case(kind, seed, kv_lens, [1] * len(kv_lens), block_size,
                                       window)  # fmt: skip
    ring, ref = ring_case(c, dq, starts, slots, seed)
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens)
    got = paged_attention_decode_triton(
        *args, scale=c.scale, sliding_window=window, num_splits=splits, tile_n=16,
        kv_layout=fmt, heads=heads, ring=ring,
    )  # fmt: skip
    assert_close(got, ref.ref(decode=True))
    if splits == 1 and heads == 1:
        _, ref16 = ring_case(c, dq, starts, slots, seed, bf16_pages=fmt is not None)
        assert_close(paged_attention_decode_torch(*args, scale=c.scale, sliding_window=window,
                                                  kv_layout=fmt, ring=ring),
                     ref16.ref(decode=True))  # fmt: skip


def test_bad_ring_is_refused_by_name():
    c, (k_raw, v_raw), fmt, dq = _case("fp8", 5, [9, 4], [1, 1], 8, None)
    ring, _ = ring_case(c, dq, [0, 0], [0, 1], 5)
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.kv_lens)
    bad = {
        "ring.k must be a contiguous": ring._replace(k=ring.k[:, :1]),
        "ring.v must be torch.float32": ring._replace(v=ring.v.double()),
        "ring.lo must be int32": ring._replace(lo=ring.lo.long()),
        "ring.base must be int32 \\(2,\\)": ring._replace(base=ring.base[:1]),
        "ring.size must be a positive int, got 0": ring._replace(size=0),
    }
    for message, r in bad.items():
        with pytest.raises(ValueError, match=message):
            paged_attention_decode_torch(*args, scale=c.scale, kv_layout=fmt, ring=r)
    with pytest.raises(TypeError, match="ring must be a RecentRing, got tuple"):
        paged_attention_decode_torch(*args, scale=c.scale, kv_layout=fmt, ring=tuple(ring))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "fp4", "plain"])
@pytest.mark.parametrize("ring_window", [0, 5])
def test_cuda_bf16_ring_matches_the_torch_path(kind, ring_window):
    """bf16 on the GPU (fp4 with its fp16 tiles turned off by the ring): the kernels against
    the torch path over the same ring, decode and prefill; ``ring_window`` 5: each query
    bounded by its own window."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv_lens, q_lens = [300, 17, 129, 64], [1, 17, 40, 3]
    c, (k_raw, v_raw), fmt, dq = _case(kind, 7, kv_lens, q_lens, 16, None)
    ring, _ = ring_case(c, dq, [0, 0, 100, 60], [3, 0, 1, 2], 7)
    ring = RecentRing(ring.k.nan_to_num().bfloat16(), ring.v.nan_to_num().bfloat16(),
                      ring.base, ring.lo, ring.size, ring_window)  # fmt: skip
    q = c.q.bfloat16()
    if kind == "plain":
        k_raw, v_raw = k_raw.nan_to_num().bfloat16(), v_raw.nan_to_num().bfloat16()

    def run(fn, *extra, **kw):
        cuda = [t.cuda() if isinstance(t, torch.Tensor) else t for t in extra]
        r = RecentRing(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in ring))
        return fn(*cuda, scale=c.scale, kv_layout=fmt, ring=r, **kw).cpu()

    want = paged_attention_prefill_torch(q, k_raw, v_raw, c.page_ids, c.page_start,
                                         c.cu_seqlens_q, c.kv_lens, scale=c.scale,
                                         kv_layout=fmt, ring=ring)  # fmt: skip
    got = run(paged_attention_prefill_triton, q, k_raw, v_raw, c.page_ids, c.page_start,
              c.cu_seqlens_q, c.kv_lens)  # fmt: skip
    assert_close(got, want, atol=2e-2, rtol=2e-2)
    last = c.cu_seqlens_q[1:].long() - 1  # each sequence's last query: a decode
    want_d = paged_attention_decode_torch(q[last], k_raw, v_raw, c.page_ids, c.page_start,
                                          c.kv_lens, scale=c.scale, kv_layout=fmt,
                                          ring=ring)  # fmt: skip
    got_d = run(paged_attention_decode_triton, q[last].contiguous(), k_raw, v_raw, c.page_ids,
                c.page_start, c.kv_lens)  # fmt: skip
    assert_close(got_d, want_d, atol=2e-2, rtol=2e-2)


def per_query_ref(c: Case, pages: Case, ring: RecentRing, decode: bool) -> torch.Tensor:
    """float64 per-query loop: the query at position ``p`` reads key ``j`` from the ring when
    ``j >= max(p - ring.window + 1, ring.lo[b])``, else from ``pages`` (float caches)."""
    bs, hkv = pages.k_cache.shape[1], pages.k_cache.shape[2]
    num_heads = c.q.shape[1]
    group = num_heads // hkv
    kv_lens = c.kv_lens.tolist()
    cu = list(range(len(kv_lens) + 1)) if decode else c.cu_seqlens_q.tolist()
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    for b, kv_len in enumerate(kv_lens):
        q_len = cu[b + 1] - cu[b]
        base, lo = int(ring.base[b]), int(ring.lo[b])
        for i in range(q_len):
            p = kv_len - q_len + i
            own = max(p - ring.window + 1, lo)
            first = 0 if c.window is None else max(0, p - c.window + 1)
            ks, vs = [], []
            for j in range(first, p + 1):
                if j >= own:
                    ks.append(ring.k[base + j % ring.size].double())
                    vs.append(ring.v[base + j % ring.size].double())
                else:
                    blk = int(c.page_ids[int(c.page_start[b]) + j // bs])
                    ks.append(pages.k_cache[blk, j % bs].double())
                    vs.append(pages.v_cache[blk, j % bs].double())
            k, v = torch.stack(ks), torch.stack(vs)  # [n, Hkv, D]
            for h in range(num_heads):
                s = (k[:, h // group] @ c.q[cu[b] + i, h].double()) * c.scale
                out[cu[b] + i, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out.to(c.q.dtype)


@pytest.mark.parametrize("kind,seed,kv_lens,q_lens,starts,slots,block_size,window", CASES)
@pytest.mark.parametrize("ring_window", [2, 5])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_each_query_bounded_by_its_own_window(kind, seed, kv_lens, q_lens, starts, slots,
                                              block_size, window, ring_window, path):  # fmt: skip
    """``RecentRing.window``: a query reads its own last W keys from the ring (within what
    the ring holds: ``lo``), earlier keys from the pages, so keys near a step's start are
    exact for its later queries and quantized for its earlier ones (Triton prefill: the
    straddling keys from both sources under complementary masks; torch: pages and ring side
    by side)."""
    c, (k_raw, v_raw), fmt, dq = _case(kind, seed, kv_lens, q_lens, block_size, window)
    torch_path = path == "torch"
    ring, _ = ring_case(c, dq, starts, slots, seed)
    ring = ring._replace(window=ring_window)
    pages = dq
    if torch_path and fmt is not None:  # the torch path reads bf16-dequantized pages
        pages = Case(dq.q, dq.k_cache.bfloat16().float(), dq.v_cache.bfloat16().float(),
                     dq.page_ids, dq.page_start, dq.cu_seqlens_q, dq.kv_lens, dq.scale,
                     dq.window)  # fmt: skip
    args = (c.q, k_raw, v_raw, c.page_ids, c.page_start, c.cu_seqlens_q, c.kv_lens)
    got = _prefill(path, args, c.scale, window, q_lens, fmt, ring)
    assert_close(got, per_query_ref(c, pages, ring, decode=False))
    one_bound = paged_attention_prefill_torch(*args, scale=c.scale, sliding_window=window,
                                              kv_layout=fmt, ring=ring._replace(window=0))  # fmt: skip
    if any(q > 1 and kv - q + 1 - ring_window + 1 >= lo for q, kv, lo
           in zip(q_lens, kv_lens, ring.lo.tolist())):  # fmt: skip
        assert (one_bound - got).abs().max() > 1e-3  # some query's own bound mattered
    # decode: each sequence's last query alone
    d, (dk, dv), dfmt, ddq = _case(kind, seed, kv_lens, [1] * len(kv_lens), block_size, window)
    dring, _ = ring_case(d, ddq, starts, slots, seed)
    dring = dring._replace(window=ring_window)
    got_d = paged_attention_decode_triton(
        d.q, dk, dv, d.page_ids, d.page_start, d.kv_lens, scale=d.scale, sliding_window=window,
        num_splits=2, tile_n=16, kv_layout=dfmt, ring=dring,
    )  # fmt: skip
    assert_close(got_d, per_query_ref(d, ddq, dring, decode=True))
