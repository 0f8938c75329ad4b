"""prepare_decode: a worked example by hand, and random batches == the per-token reference."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_cases import assert_fields_equal, random_config, random_decode_batch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_decode
from kvplan.plan.reference import reference_decode

CFG = MetadataConfig(
    block_size=4,
    dense_ratios=(2,),
    sparse_ratios=(2, 4),
    window_size=4,
    swa_block_size=6,
    max_model_len=64,
    max_num_blocks=32,
    max_ngram_size=3,
    pad_token_id=-7,
)


def _t(x):
    return torch.tensor(x, dtype=torch.int32)


def test_worked_example():
    s = SequenceMetadata(
        seqlen_q=2,
        seqlen_k=7,
        block_table=[5, 9, 3, 4],
        state_id=1,
        token_ids=list(range(10, 16)),
        draft_tokens=[99],
        compressed_token_ids=[100, 101, 102],
        lookup_table=np.arange(200) + 1000,
        image_positions=[4],
    )
    m = prepare_decode([s], CFG)
    assert torch.equal(m.positions, _t([5, 6]))
    assert torch.equal(m.input_ids, _t([15, 99]))
    # image token at 4: position 5 sees itself only, position 6 sees 6 (draft 99) and 5
    assert torch.equal(m.ngram_token_ids, _t([[1015, -7, -7], [1099, 1015, -7]]))
    assert torch.equal(m.context_lens, _t([6, 7]))
    assert torch.equal(m.klen["2"], _t([3, 3]))
    assert torch.equal(m.klen["4"], _t([1, 1]))
    assert torch.equal(m.slot_mapping_store_swa, _t([6 + 5, 6 + 0]))
    assert torch.equal(m.kv_swa_index_offset_len, _t([[6 + 2, 4], [6 + 3, 4]]))
    assert torch.equal(m.positions_c["2"], _t([4, 0]))
    assert torch.equal(m.slot_mapping_store_ca["2"], _t([9 * 2 + 0, -1]))
    assert torch.equal(m.slot_mapping_store_ca["4"], _t([-1, -1]))
    assert torch.equal(m.kv_ca_index_offset_len["2"], _t([[0, 3], [32 * 2, 3]]))
    assert torch.equal(m.block_tables[:, :2], _t([[5, 9], [5, 9]]))
    assert torch.equal(m.cu_seqlens_q, _t([0, 2]))
    assert torch.equal(m.cu_seqlens_k, _t([0, 7]))
    assert torch.equal(m.query_indices, _t([0, 0]))
    assert m.valid_token_mask.tolist() == [True, True]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_decode_matches_reference(seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    seqs = random_decode_batch(rng, cfg)
    meta = prepare_decode(seqs, cfg)
    prefix = [cfg.num_blocks_for(s.seqlen_k) for s in seqs for _ in range(s.seqlen_q)]
    assert_fields_equal(meta, reference_decode(seqs, cfg), block_table_prefix=prefix)


def test_block_table_columns_past_the_longest_table_are_not_written():
    cfg = CFG
    a = SequenceMetadata(seqlen_q=1, seqlen_k=9, block_table=[5, 9, 3], state_id=0,
                         token_ids=list(range(9)), lookup_table=np.arange(100))  # fmt: skip
    b = SequenceMetadata(seqlen_q=1, seqlen_k=3, block_table=[4], state_id=1,
                         token_ids=list(range(3)), lookup_table=np.arange(100))  # fmt: skip
    ref = prepare_decode([a, b], cfg)
    out = {k: torch.full((8, *v.shape[1:]), 77, dtype=v.dtype)
           for k, v in vars(ref).items() if isinstance(v, torch.Tensor)}  # fmt: skip
    out.update({k: {kk: torch.full((8, *vv.shape[1:]), 77, dtype=vv.dtype) for kk, vv in v.items()}
                for k, v in vars(ref).items() if isinstance(v, dict) and v})  # fmt: skip
    meta = prepare_decode([a, b], cfg, out=out)
    # 9 // 2 = 4 compressed tokens at 2 per block -> 2 blocks; 3 // 2 = 1 token -> 1 block
    assert meta.block_tables.shape == (2, cfg.max_num_blocks)
    assert meta.block_tables[0, :2].tolist() == [5, 9] and meta.block_tables[1, 0] == 4
    assert out["block_tables"][:2, 2:].eq(77).all()  # past the longest table: untouched
    assert out["block_tables"][2:].eq(77).all()  # rows past the step: untouched
