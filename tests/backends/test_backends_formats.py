"""The three kernel formats: hand-checked examples, equal blocks and slots, self-checks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from backends_testlib import (
    CAP,
    SeqSpec,
    assert_close,
    fill_metadata,
    make_scenario,
    random_specs,
    reference_attention,
)

from kvplan.backends import (
    BlockOffsetsAttentionMetadata,
    RaggedAttentionMetadata,
    VanillaAttentionMetadata,
    get_backend,
)
from kvplan.backends.ragged import page_table_problems
from kvplan.cache.kv_cache_manager import KVCacheManager


def prepared(cls, sc, **kw):
    md = cls(kv_cache_manager=sc.manager, kv_cache=sc.kv, **CAP, **kw)
    fill_metadata(md, sc)
    md.prepare()
    return md


@pytest.mark.parametrize(("beam_width", "cross"), [(1, False), (2, False), (3, True)])
def test_three_encodings_name_the_same_blocks(beam_width, cross):
    if cross:
        specs = [SeqSpec(9, 4, True), SeqSpec(14, 1, False), SeqSpec(5, 1, False)]
    else:
        specs = random_specs(21, num_ctx=3, num_gen=4)
    sc = make_scenario(21, specs, beam_width=beam_width, cross=cross, layer_windows=(None, 8))
    van = prepared(VanillaAttentionMetadata, sc)
    rag = prepared(RaggedAttentionMetadata, sc, check_page_table=True)
    blk = prepared(BlockOffsetsAttentionMetadata, sc)
    bs = sc.manager.block_size
    nc = sc.num_contexts
    n = len(sc.seq_lens)
    for pool in range(sc.manager.num_pools):
        offsets = blk.kv_cache_block_offsets[pool]
        indices = rag.paged_kv_indices(pool)
        for b in range(n):
            kv_len = int(van.kv_lens_np[b])
            nb = -(-kv_len // bs)
            # what the manager holds for this row (the test's own expansion of beams)
            rid = sc.request_ids[b if b < nc else nc + (b - nc) // beam_width]
            if cross:
                want = sc.manager.get_cross_block_ids(rid, pool)[:nb]
            else:
                beam = 0 if b < nc else (b - nc) % beam_width
                want = sc.manager.get_block_ids(rid, pool, beam=beam)[:nb]
            assert van.block_ids_per_seq[pool][b, :nb].tolist() == want
            start = int(rag.paged_kv_indptr[b])
            assert indices[start : start + nb].tolist() == want
            assert offsets[b, 0, :nb].tolist() == want
            assert offsets[b, 1, :nb].tolist() == want, "V entries name the K blocks"
            last = int(rag.paged_kv_last_page_len[b])
            assert (nb - 1) * bs + last == kv_len
        slots = van.slot_mapping(pool).tolist()
        assert rag.slot_mapping(pool).tolist() == slots
        assert blk.slot_mapping(pool).tolist() == slots
    assert rag.kv_lens.tolist() == blk.kv_lens_cuda.tolist() == van.kv_lens_np.tolist()
    assert rag.page_table_reports == []


def test_ragged_format_by_hand():
    mgr = KVCacheManager(16, 4, max_blocks_per_seq=4, enable_prefix_caching=False)
    mgr.add_request("a", list(range(6)))  # blocks [1, 2], 6 tokens
    mgr.add_request("b", list(range(9)))  # blocks [3, 4, 5], 9 cached tokens
    assert mgr.extend("b", 1).ok  # token 9 goes to block 5, offset 1
    md = RaggedAttentionMetadata(
        max_num_requests=4, max_num_tokens=32, kv_cache_manager=mgr, check_page_table=True
    )
    md.request_ids = ["a", "b"]
    md.num_contexts = 1
    md.seq_lens = [6, 1]
    md.num_cached_tokens_per_seq = [0, 9]
    md.prepare()
    assert md.paged_kv_indices().tolist() == [1, 2, 3, 4, 5]
    assert md.paged_kv_indptr.tolist() == [0, 2, 5]
    assert md.paged_kv_indptr_prefill.tolist() == [0, 2]
    assert md.paged_kv_indptr_decode.tolist() == [0, 3]
    assert md.paged_kv_last_page_len.tolist() == [2, 2]
    assert md.qo_indptr[:3].tolist() == [0, 6, 7]
    assert md.batch_indices.tolist() == [0] * 6 + [1]
    assert md.positions.tolist() == [0, 1, 2, 3, 4, 5, 9]
    assert md.slot_mapping().tolist() == [4, 5, 6, 7, 8, 9, 21]
    assert md.page_table_reports == []


def test_block_offsets_fields_by_hand():
    mgr = KVCacheManager(16, 4, max_blocks_per_seq=5, enable_prefix_caching=False)
    mgr.add_request("a", list(range(3)))  # block [1]
    mgr.add_request("b", list(range(5)))  # blocks [2, 3]
    assert mgr.extend("b", 1).ok and mgr.reserve("b", 3).ok  # token 5, then a reserved block
    assert mgr.reserve("a", 2).ok  # every row needs blocks for the 2 draft tokens: block 5
    md = BlockOffsetsAttentionMetadata(
        max_num_requests=2, max_num_tokens=8, kv_cache_manager=mgr, num_extra_kv_tokens=2,
        enable_block_id_tables=True,
    )  # fmt: skip
    md.request_ids = ["a", "b"]
    md.num_contexts = 1
    md.seq_lens = [3, 1]
    md.num_cached_tokens_per_seq = [0, 5]
    md.prompt_lens = [3, 5]
    md.prepare()
    assert md.kv_lens.tolist() == [5, 8]  # addressable: + 2 draft tokens
    assert md.kv_lens_cuda.tolist() == [3, 6]  # attended
    assert md.host_total_kv_lens.tolist() == [3, 6]
    assert md.host_request_types[:2].tolist() == [0, 1]
    assert md.prompt_lens_cuda[:2].tolist() == [3, 5]
    assert md.copied_width == 5  # extra draft tokens: full width
    assert md.kv_cache_block_offsets[0, :2, 0].tolist() == [[1, 5, 0, 0, 0], [2, 3, 4, 0, 0]]
    assert md.kv_block_ids_per_seq[:2].tolist() == [[1, 5, 0, 0, 0], [2, 3, 0, 0, 0]]
    assert md.block_ids_per_seq[:2].tolist() == [[2, 3, 0, 0, 0], [0] * 5], "generation first"
    assert md.slot_mapping().tolist() == [4, 5, 6, 13]
    md2 = BlockOffsetsAttentionMetadata(max_num_requests=2, max_num_tokens=8, kv_cache_manager=mgr)
    md2.request_ids = ["a", "b"]
    md2.num_contexts = 1
    md2.seq_lens = [3, 1]
    md2.num_cached_tokens_per_seq = [0, 5]
    md2.prepare()
    assert md2.copied_width == 5, "full rows, with or without a speculative path"
    assert md2.kv_cache_block_offsets[0, :2, 1].tolist() == [[1, 5, 0, 0, 0], [2, 3, 4, 0, 0]]


def test_block_offsets_encoder_only_marks_every_row_context():
    md = BlockOffsetsAttentionMetadata(max_num_requests=4, max_num_tokens=32)
    md.host_request_types.fill_(1)  # stale values from an earlier step
    md.seq_lens = [4, 2, 3]
    md.prepare_encoder_only()
    assert md.num_contexts == 3
    assert md.host_request_types[:3].tolist() == [0, 0, 0]
    assert md.host_total_kv_lens.tolist() == [9, 0]
    mgr = KVCacheManager(8, 4, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="without a kv_cache_manager"):
        BlockOffsetsAttentionMetadata(
            max_num_requests=4, max_num_tokens=32, kv_cache_manager=mgr
        ).prepare_encoder_only()


@pytest.mark.parametrize("cls", [RaggedAttentionMetadata, BlockOffsetsAttentionMetadata])
def test_generation_rows_need_a_cache(cls):
    md = cls(max_num_requests=4, max_num_tokens=32)
    md.num_contexts = 1
    md.seq_lens = [4, 1]
    with pytest.raises(ValueError, match="context-only"):
        md.prepare()


@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_vswa_layers_read_their_own_pool(name):
    specs = random_specs(4, num_ctx=2, num_gen=3)
    sc = make_scenario(4, specs, layer_windows=(None, 6, None), remap_pools=True)
    assert sc.manager.num_pools == 2
    cls = get_backend(name)
    md = prepared(cls.Metadata, sc)
    if name == "ragged":
        a, b = md.paged_kv_indices(0).tolist(), md.paged_kv_indices(1).tolist()
        assert len(a) == len(b) and all(x + y == 200 for x, y in zip(a, b))
    if name == "block_offsets":
        n = md.num_seqs
        a, b = md.kv_cache_block_offsets[0, :n], md.kv_cache_block_offsets[1, :n]
        assert ((a + b == 200) | ((a == 0) & (b == 0))).all() and (a > 0).any()
    assert md.slot_mapping(0).tolist() != md.slot_mapping(1).tolist()
    for layer, window in enumerate(sc.layer_windows):
        out = cls(layer, 4, 2, 16, sliding_window=window).forward(
            sc.q, sc.k[layer], sc.v[layer], md
        )
        assert_close(out, reference_attention(sc, layer, window), atol=1e-5)


def test_page_table_self_check_reports_within_budget(caplog):
    kv_lens = np.array([5, 8], np.int32)
    logical = np.array([2, 2], np.int32)
    good = dict(
        kv_lens=kv_lens, logical_nb=logical, num_blocks=np.array([2, 3], np.int32),
        indptr=np.array([0, 2, 5], np.int32), last_page_len=np.array([1, 4], np.int32),
        num_indices=5, block_size=4,
    )  # fmt: skip
    assert page_table_problems(**good) == []
    bad = dict(good, last_page_len=np.array([2, 4], np.int32), num_indices=4)
    assert len(page_table_problems(**bad)) == 2
    assert len(page_table_problems(**dict(good, num_blocks=np.array([1, 3], np.int32)))) == 2
    sc = make_scenario(1, [SeqSpec(0, 5, True), SeqSpec(6, 1, False)])
    md = prepared(RaggedAttentionMetadata, sc, check_page_table=True, page_table_check_budget=1)
    assert md.page_table_reports == []
    md.kv_lens_np = md.kv_lens_np + 1  # corrupt the lengths behind the table's back
    with caplog.at_level(logging.WARNING):
        md._self_check(4)
        md._self_check(4)
    assert len(md.page_table_reports) == 1 and md.page_table_check_budget == 0
    assert "self-check" in caplog.text


def test_seq_lens_device_copies_in_graph_mode_keep_addresses():
    sc = make_scenario(2, [SeqSpec(3, 1, False), SeqSpec(7, 1, False)])
    md = prepared(RaggedAttentionMetadata, sc, is_cuda_graph=True)
    ptrs = (md.qo_indptr.data_ptr(), md.paged_kv_indices().data_ptr(), md.kv_lens.data_ptr())
    md.num_cached_tokens_per_seq = [3, 7]
    md.seq_lens = [1, 1]
    md.prepare()
    assert (
        md.qo_indptr.data_ptr(),
        md.paged_kv_indices().data_ptr(),
        md.kv_lens.data_ptr(),
    ) == ptrs
    assert torch.equal(md.qo_indptr[:3], torch.tensor([0, 1, 2], dtype=torch.int32))
