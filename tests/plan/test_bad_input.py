"""Bad input raises ValueError/TypeError naming the field and value, before anything is written."""

import dataclasses

import numpy as np
import pytest
import torch

from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_decode, prepare_prompt

CFG = MetadataConfig(
    block_size=8, dense_ratios=(2,), sparse_ratios=(4,), window_size=4, swa_block_size=6,
    max_model_len=64, max_num_blocks=8, num_kv_blocks=100, num_state_slots=10,
)  # fmt: skip

PROMPT = SequenceMetadata(
    seqlen_q=5, seqlen_k=20, block_table=[3, 4, 5], state_id=1, token_ids=list(range(20))
)  # 20 // 2 = 10 tokens, 4 per block: 3 blocks
DECODE = SequenceMetadata(seqlen_q=2, seqlen_k=20, block_table=[3, 4, 5], state_id=1,
                          token_ids=list(range(19)), draft_tokens=(7,))  # fmt: skip


def _with(seq, **kw):
    return dataclasses.replace(seq, **kw)


@pytest.mark.parametrize(
    "seq, match",
    [
        (_with(PROMPT, seqlen_q=21), r"seqs\[0\]\.seqlen_k = 20"),
        (_with(PROMPT, seqlen_q=0), r"seqlen_q = 0"),
        (_with(PROMPT, seqlen_k=65, seqlen_q=1, token_ids=list(range(65))), "max_model_len"),
        (_with(PROMPT, block_table=[3]), r"block_table.*needs 3"),
        (_with(PROMPT, block_table=[3, -4, 5]), r"block_table = -4"),
        (_with(PROMPT, block_table=[3, 4, 100]), r"block_table = 100.*out of range"),
        (_with(PROMPT, state_id=10), r"state_id = 10.*out of range"),
        (_with(PROMPT, state_id=-1), r"state_id = -1"),
        (_with(PROMPT, draft_tokens=(1,)), r"draft_tokens = \[1\].*prompt"),
        (_with(PROMPT, token_ids=[0] * 19), r"token_ids.*needs >= seqlen_k = 20"),
        (_with(PROMPT, swa_valid_start=16), r"swa_valid_start = 16"),
    ],
)
def test_bad_prompt_sequence(seq, match):
    with pytest.raises(ValueError, match=match):
        prepare_prompt([PROMPT, seq] if "seqs\\[0\\]" not in match else [seq], CFG)


@pytest.mark.parametrize(
    "seq, match",
    [
        (_with(DECODE, draft_tokens=()), r"seqlen_q = 2.*1 \+ len\(draft_tokens\) = 1"),
        (_with(DECODE, token_ids=list(range(20))), r"token_ids.*needs 19 ids"),
        (_with(DECODE, seqlen_q=4, draft_tokens=(1, 2, 3), token_ids=list(range(17))), "SWA ring"),
        (_with(DECODE, block_table=[3, 4]), r"block_table.*needs 3"),
    ],
)
def test_bad_decode_sequence(seq, match):
    with pytest.raises(ValueError, match=match):
        prepare_decode([DECODE, seq], CFG)


def test_bad_batch_types():
    with pytest.raises(ValueError, match="empty"):
        prepare_decode([], CFG)
    with pytest.raises(TypeError, match=r"seqs\[0\] must be a SequenceMetadata"):
        prepare_decode([{"seqlen_q": 1}], CFG)
    with pytest.raises(TypeError, match="config must be a MetadataConfig"):
        prepare_prompt([PROMPT], {"block_size": 8})


def test_int32_overflow_of_decode_offsets():
    cfg = MetadataConfig(
        block_size=64, dense_ratios=(1,), sparse_ratios=(), window_size=4, swa_block_size=4,
        max_model_len=2**24, max_num_blocks=2**18,
    )  # fmt: skip
    seqs = [SequenceMetadata(seqlen_q=1, seqlen_k=1, block_table=[0], state_id=i, token_ids=[1])
            for i in range(128)]  # fmt: skip
    with pytest.raises(ValueError, match="overflows int32"):
        prepare_decode(seqs, cfg)
    prepare_decode(seqs[:127], cfg)  # 127 * 2**18 * 64 < 2**31


def test_int32_overflow_of_slots():
    cfg = dataclasses.replace(CFG, num_kv_blocks=None, num_state_slots=None)
    with pytest.raises(ValueError, match="block id \\* block_size.*overflows int32"):
        prepare_prompt([_with(PROMPT, block_table=[3, 2**28, 5])], cfg)
    with pytest.raises(ValueError, match="state_id = .*overflows int32"):
        prepare_prompt([_with(PROMPT, state_id=2**29)], cfg)


def test_bad_out_for_prompt_leaves_buffers_untouched():
    ref = prepare_prompt([PROMPT], CFG)
    out = {k: torch.full((64, *v.shape[1:]), 5, dtype=v.dtype)
           for k, v in vars(ref).items() if isinstance(v, torch.Tensor)}  # fmt: skip
    out.update({k: {kk: torch.full((64, *vv.shape[1:]), 5, dtype=vv.dtype) for kk, vv in v.items()}
                for k, v in vars(ref).items() if isinstance(v, dict) and v
                and isinstance(next(iter(v.values())), torch.Tensor)})  # fmt: skip
    good = prepare_prompt([PROMPT], CFG, out=out)
    assert torch.equal(good.kv_swa_full_index_pivots, ref.kv_swa_full_index_pivots)
    out["ks"]["4"] = torch.zeros(64, dtype=torch.int64)
    snapshot = {k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(TypeError, match=r"ks\['4'\].*int32"):
        prepare_prompt([_with(PROMPT, token_ids=np.arange(20) + 1)], CFG, out=out)
    assert all(torch.equal(out[k], v) for k, v in snapshot.items())


def test_float_block_ids_are_rejected_not_truncated():
    import numpy as np

    from kvplan.plan import MetadataConfig, SequenceMetadata, prepare_decode

    cfg = MetadataConfig(
        block_size=16,
        dense_ratios=(4,),
        sparse_ratios=(),
        window_size=8,
        swa_block_size=16,
        max_model_len=128,
        max_num_blocks=8,
    )
    seq = SequenceMetadata(
        seqlen_q=1, seqlen_k=5, block_table=np.array([1.5]), state_id=0, token_ids=[1, 2, 3, 4, 5]
    )
    with pytest.raises(TypeError, match="block_table"):
        prepare_decode([seq], cfg)
