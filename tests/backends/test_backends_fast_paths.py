"""prepare()'s decode branches (one new K/V token per row) against its general path.

``decode_fast_path = False`` makes ``prepare()`` take the general path on the same batch; every
device field the kernels read and every host array the metadata exposes must be identical, on
random decode batches (block sizes, beam widths, VSWA pools, reserved blocks past the logical
ones), and the decode batch's attention must equal the dense reference. Batches the branch
must not take (a prefill row, a speculative row, draft tokens past the step's tokens) give the
same tensors either way by construction, and are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest
from backends_testlib import (
    CAP,
    SeqSpec,
    assert_close,
    assert_same,
    fill_metadata,
    make_scenario,
    prepared_each,
    reference_attention,
)

from kvplan.backends import get_backend

VARIANTS = [
    ("vanilla", {}),
    ("ragged", {"check_page_table": True}),
    ("ragged", {"use_full_generation_page_table": True}),
    ("block_offsets", {}),
    ("block_offsets", {"enable_block_id_tables": True}),
]


def decode_specs(rng: np.random.Generator, num_rows: int, max_cached: int) -> list[SeqSpec]:
    """Decode rows (one query token each); some with reserved blocks past the logical ones."""
    return [
        SeqSpec(int(rng.integers(1, max_cached)), 1, False, int(rng.integers(0, 9)) * (i % 2))
        for i in range(num_rows)
    ]


def prepared_both_ways(name: str, sc, md_kwargs: dict):
    """The batch prepared with the decode branches (``fast``) and without (``general``)."""
    return prepared_each(name, sc, {**CAP, **md_kwargs}, "decode_fast_path", (True, False))


@pytest.mark.parametrize(("name", "md_kwargs"), VARIANTS)
@pytest.mark.parametrize("seed", range(4))
def test_decode_branch_equals_general_path(name, md_kwargs, seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([2, 4, 8]))
    beam_width = 2 if seed % 2 else 1
    windows = (None, 6) if seed >= 2 else (None,)
    specs = decode_specs(rng, int(rng.integers(1, 7)), max_cached=40)
    sc = make_scenario(seed, specs, beam_width=beam_width, layer_windows=windows,
                       block_size=block_size, max_blocks_per_seq=28)  # fmt: skip
    fast, general = prepared_both_ways(name, sc, md_kwargs)
    assert fast.one_kv_token_per_row and fast.one_query_per_row
    assert_same(name, sc, fast, general)
    for layer, window in enumerate(sc.layer_windows):
        attn = get_backend(name)(
            layer, sc.num_heads, sc.num_kv_heads, sc.head_dim, sliding_window=window
        )
        out = attn.forward(sc.q, sc.k[layer], sc.v[layer], fast)
        assert_close(out, reference_attention(sc, layer, window), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "md_kwargs", "spec"),
    [
        ("vanilla", {}, SeqSpec(5, 3, True)),  # a prefill row
        ("ragged", {}, SeqSpec(9, 2, False, 3)),  # a speculative row (2 query tokens)
        ("block_offsets", {"num_extra_kv_tokens": 2}, SeqSpec(6, 1, False, 4)),  # draft tokens
    ],
)
def test_batches_outside_the_decode_branch(name, md_kwargs, spec):
    rng = np.random.default_rng(11)
    specs = [*decode_specs(rng, 3, max_cached=30), spec]
    for s in specs:  # every row owns blocks for the draft tokens past it
        s.reserve_extra = max(s.reserve_extra, md_kwargs.get("num_extra_kv_tokens", 0))
    sc = make_scenario(11, specs)
    fast, general = prepared_both_ways(name, sc, md_kwargs)
    assert_same(name, sc, fast, general)


@pytest.mark.parametrize("name", ["vanilla", "ragged", "block_offsets"])
def test_decode_branch_rejects_a_missing_block(name):
    """A decode row whose new token lies past its allocated blocks is a caller error on both
    paths (the decode branch gathers only the last block of each row)."""
    sc = make_scenario(3, [SeqSpec(7, 1, False), SeqSpec(4, 1, False)])
    for fast in (True, False):
        md = get_backend(name).Metadata(kv_cache_manager=sc.manager, kv_cache=sc.kv, **CAP)
        md.decode_fast_path = fast
        fill_metadata(md, sc)
        md.num_cached_tokens_per_seq = [7, 8]  # row 1's token 9 needs a third block of 4
        with pytest.raises(ValueError, match="sequence 1 needs 3 blocks"):
            md.prepare()
