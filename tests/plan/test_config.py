"""MetadataConfig validation and derived values."""

import pytest

from kvplan.plan.config import MetadataConfig, ratio_key

BASE = dict(
    block_size=64,
    dense_ratios=(4,),
    sparse_ratios=(4, 16),
    window_size=128,
    swa_block_size=136,
    max_model_len=4096,
    max_num_blocks=64,
)


def test_derived_values():
    cfg = MetadataConfig(**BASE)
    assert cfg.ca_ratios == (4, 16)
    assert cfg.min_ratio == 4
    assert cfg.tokens_per_block(16) == 4
    assert cfg.kv_ca_index_width(4) == 1024
    assert cfg.kv_ca_index_width(16) == 256
    # 4096 // 4 = 1024 compressed tokens at 16 per block = 64 blocks
    assert cfg.num_blocks_for(4096) == 64
    assert cfg.num_blocks_for(3) == 0
    assert cfg.num_blocks_for(4) == 1
    assert cfg.num_blocks_for(16 * 4 * 4 + 4) == 5  # 260 // 4 = 65 tokens -> 5 blocks
    assert ratio_key(16) == "16"


def test_no_ratio_counts_raw_tokens():
    cfg = MetadataConfig(**{**BASE, "dense_ratios": (), "sparse_ratios": ()})
    assert cfg.min_ratio == 1
    assert cfg.num_blocks_for(65) == 2


@pytest.mark.parametrize(
    "change, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"dense_ratios": (3,)}, "dense_ratios entry 3 must divide"),
        ({"sparse_ratios": [4]}, "sparse_ratios must be a tuple"),
        ({"sparse_ratios": (4, 4)}, "duplicates"),
        ({"swa_block_size": 100}, "swa_block_size=100 must be >= window_size=128"),
        ({"max_num_blocks": 63}, "max_num_blocks=63 cannot cover"),
        ({"cp_size": 2, "cp_rank": 2}, "cp_rank=2"),
        ({"yoco_keep_tokens": 8}, "both set"),
        ({"yoco_keep_tokens": 8, "yoco_mode": "fast"}, "yoco_mode"),
        ({"max_ngram_size": -1}, "max_ngram_size"),
        ({"device": "nonsense"}, "device"),
        ({"num_kv_blocks": 2**26, "block_size": 64}, "overflows int32"),
    ],
)
def test_bad_config(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MetadataConfig(**{**BASE, **change})


def test_frozen():
    cfg = MetadataConfig(**BASE)
    with pytest.raises(AttributeError):
        cfg.block_size = 32  # type: ignore[misc]
