"""The correctness oracle: metadata -> visible (source, position) sets == DESIGN.md's rules."""

import numpy as np
import pytest
import torch
from plan_cases import random_config, random_decode_batch, random_prompt_batch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_decode, prepare_prompt
from kvplan.plan.visibility import check_visibility, expected_row


@pytest.mark.parametrize("seed", range(40))
def test_prompt_visibility(seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    seqs = random_prompt_batch(rng, cfg)
    check_visibility(prepare_prompt(seqs, cfg), seqs, cfg)


@pytest.mark.parametrize("seed", range(40))
def test_decode_visibility(seed):
    rng = np.random.default_rng(1000 + seed)
    cfg = random_config(rng)
    seqs = random_decode_batch(rng, cfg)
    check_visibility(prepare_decode(seqs, cfg), seqs, cfg)


def _chunked_history_config():
    return MetadataConfig(
        block_size=8, dense_ratios=(2,), sparse_ratios=(4, 8), window_size=6, swa_block_size=8,
        max_model_len=128, max_num_blocks=64,
    )  # fmt: skip


def test_chunked_prefill_then_decode_with_drafts():
    """Chunks over history, swa_valid_start > 0, a ratio larger than a sequence, drafts."""
    cfg = _chunked_history_config()
    table = np.arange(100, 164)
    a = SequenceMetadata(seqlen_q=10, seqlen_k=40, block_table=table, state_id=2,
                         token_ids=np.zeros(40), swa_valid_start=30)  # fmt: skip
    b = SequenceMetadata(seqlen_q=5, seqlen_k=5, block_table=[7], state_id=0, token_ids=range(5))
    c = SequenceMetadata(seqlen_q=1, seqlen_k=1, block_table=[], state_id=5, token_ids=[0],
                         is_placeholder=True)  # fmt: skip
    check_visibility(prepare_prompt([a, b, c], cfg), [a, b, c], cfg)
    d = SequenceMetadata(seqlen_q=3, seqlen_k=40, block_table=table, state_id=2,
                         token_ids=np.zeros(38), draft_tokens=(1, 2), swa_valid_start=30)  # fmt: skip
    e = SequenceMetadata(seqlen_q=1, seqlen_k=6, block_table=[7], state_id=0, token_ids=range(6))
    check_visibility(prepare_decode([d, e], cfg), [d, e], cfg)


def test_seed_worked_example_visibility():
    """seqlen_k 10000, seqlen_q 1024, block 64, ratio 4, window 4096 (rows sampled)."""
    cfg = MetadataConfig(
        block_size=64, dense_ratios=(4,), sparse_ratios=(4,), window_size=4096,
        swa_block_size=4096, max_model_len=16384, max_num_blocks=256,
    )  # fmt: skip
    s = SequenceMetadata(seqlen_q=1024, seqlen_k=10000, block_table=np.arange(1000, 1157),
                         state_id=3, token_ids=np.zeros(10000))  # fmt: skip
    check_visibility(prepare_prompt([s], cfg), [s], cfg, rows=[0, 1, 700, 1023])
    assert expected_row(9999, 0, cfg)["swa"] == set(range(5904, 10000))


@pytest.mark.parametrize(
    "field, mutate",
    [
        ("kv_swa_full_index_pivots", lambda t: t[:, 0].add_(1)),
        ("kv_swa_full_index_pivots", lambda t: t[:, 3].sub_(1).clamp_(min=0)),
        ("ke", lambda d: d["4"].add_(1)),
        ("kv_ca_index_offset_len", lambda d: d["2"][:, 0].add_(1)),
        ("load_segments_swa", lambda t: t[:, 1].add_(1)),
        ("slot_mapping_store_swa", lambda t: t.fill_(-1)),
        ("slot_mapping_store_ca", lambda d: d["8"].fill_(-1)),
    ],
)
def test_oracle_catches_corruption(field, mutate):
    cfg = _chunked_history_config()
    a = SequenceMetadata(seqlen_q=10, seqlen_k=40, block_table=np.arange(100, 164), state_id=2,
                         token_ids=np.zeros(40), swa_valid_start=27)  # fmt: skip
    b = SequenceMetadata(seqlen_q=20, seqlen_k=20, block_table=[7, 8, 9], state_id=0,
                         token_ids=range(20))  # fmt: skip
    meta = prepare_prompt([a, b], cfg)
    check_visibility(meta, [a, b], cfg)
    meta = prepare_prompt([a, b], cfg)
    mutate(getattr(meta, field))
    with pytest.raises(AssertionError):
        check_visibility(meta, [a, b], cfg)


def test_decode_oracle_catches_ignored_valid_start():
    cfg = _chunked_history_config()
    d = SequenceMetadata(seqlen_q=1, seqlen_k=40, block_table=np.arange(100, 164), state_id=2,
                         token_ids=np.zeros(40), swa_valid_start=37)  # fmt: skip
    meta = prepare_decode([d], cfg)
    assert meta.kv_swa_index_offset_len[0].tolist() == [2 * 8 + 37 % 8, 3]
    meta.kv_swa_index_offset_len[0, 0] -= 2
    meta.kv_swa_index_offset_len[0, 1] += 2
    with pytest.raises(AssertionError, match="stale"):
        check_visibility(meta, [d], cfg)
    torch.testing.assert_close(meta.context_lens, torch.tensor([40], dtype=torch.int32))
