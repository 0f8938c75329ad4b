"""prepare_prompt == the per-token reference, field by field, on random batches."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_cases import assert_fields_equal, random_config, random_prompt_batch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_prompt
from kvplan.plan.reference import reference_prompt


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_prompt_matches_reference(seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    seqs = random_prompt_batch(rng, cfg)
    assert_fields_equal(prepare_prompt(seqs, cfg), reference_prompt(seqs, cfg))


def test_seed_worked_example():
    """seqlen_k 10000, seqlen_q 1024, block 64, ratio 4, window 4096 (seed 002)."""
    cfg = MetadataConfig(
        block_size=64,
        dense_ratios=(4,),
        sparse_ratios=(4,),
        window_size=4096,
        swa_block_size=4096,
        max_model_len=16384,
        max_num_blocks=256,
    )
    table = np.arange(1000, 1157)
    s = SequenceMetadata(
        seqlen_q=1024, seqlen_k=10000, block_table=table, state_id=3, token_ids=np.zeros(10000)
    )
    m = prepare_prompt([s], cfg)
    seg = m.load_segments_ca["4"]
    assert seg.shape == (157, 4) and m.total_k_compressed["4"] == 2500
    assert seg[:156, 2].eq(16).all() and seg[156].tolist() == [1156, 0, 4, 2496]
    assert seg[:, 3].tolist() == list(range(0, 2500, 16))
    assert m.load_segments_swa.tolist() == [[3, 784, 4096, 0], [3, 0, 784, 3312]]
    assert m.total_k_swa == 4096
    # first row (p = 8976) sees history 4881..8975 (buffer rows 1..4095) and itself (row 4096)
    assert m.kv_swa_full_index_pivots[0].tolist() == [1, 4095, 4096, 1]
    # last row (p = 9999) sees history 5904..8975 (rows 1024..4095) and the whole chunk
    assert m.kv_swa_full_index_pivots[-1].tolist() == [1024, 3072, 4096, 1024]
    assert m.ks["4"].eq(0).all() and m.ke["4"][0] == 8977 // 4 and m.ke["4"][-1] == 2500
    # new compressed tokens 2244 .. 2499 of the chunk [8976, 10000)
    assert m.positions_c["4"].tolist() == [4 * j for j in range(2244, 2500)]
    assert m.slot_mapping_store_ca["4"][0] == table[2244 // 16] * 16 + 2244 % 16
    # only the last 4096 rows store into the ring: all 1024 here
    assert torch.equal(
        m.slot_mapping_store_swa, torch.arange(8976, 10000, dtype=torch.int32) % 4096 + 3 * 4096
    )


def test_short_sequence_gets_one_row():
    cfg = MetadataConfig(
        block_size=8, dense_ratios=(8,), sparse_ratios=(), window_size=4, swa_block_size=4,
        max_model_len=64, max_num_blocks=8,
    )  # fmt: skip
    a = SequenceMetadata(seqlen_q=3, seqlen_k=5, block_table=[7], state_id=0, token_ids=range(5))
    b = SequenceMetadata(seqlen_q=9, seqlen_k=9, block_table=[2], state_id=1, token_ids=range(9))
    m = prepare_prompt([a, b], cfg)
    assert m.positions_c["8"].tolist() == [0, 0]
    assert m.slot_mapping_store_ca["8"].tolist() == [-1, 2 * 1 + 0]
    assert m.cu_compressed_seqlens["8"].tolist() == [0, 1, 2]
    assert m.load_segments_ca["8"].tolist() == [[-1, 0, 1, 0], [2, 0, 1, 1]]
    # second sequence's compressed keys start after the first one's zero row
    assert m.kv_ca_index_offset_len["8"][3:].tolist() == [[1, 0]] * 7 + [[1, 1]] * 2
