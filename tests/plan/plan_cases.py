"""Random configs and batches for the planning tests (fixed seeds through numpy Generators)."""

from __future__ import annotations

import numpy as np
import torch

from kvplan.plan import MetadataConfig, SequenceMetadata

VOCAB = 50


def random_config(rng: np.random.Generator, **overrides) -> MetadataConfig:
    block_size = int(rng.choice([4, 8, 16]))
    divisors = [r for r in (1, 2, 4, 8) if block_size % r == 0]
    dense = tuple(sorted(int(r) for r in divisors if rng.random() < 0.4))
    sparse = tuple(sorted(int(r) for r in divisors if rng.random() < 0.4))
    window = int(rng.integers(1, 13))
    kw = dict(
        block_size=block_size,
        dense_ratios=dense,
        sparse_ratios=sparse,
        window_size=window,
        swa_block_size=window + int(rng.integers(0, 4)),
        max_model_len=160,
        max_num_blocks=1,
        max_ngram_size=int(rng.integers(0, 4)),
        pad_token_id=-1,
        force_load_balance=bool(rng.random() < 0.5),
    )
    kw.update(overrides)
    probe = MetadataConfig(**{**kw, "max_num_blocks": 10**6})
    kw["max_num_blocks"] = probe.num_blocks_for(kw["max_model_len"]) + int(rng.integers(0, 3))
    return MetadataConfig(**kw)


def _seq(rng, cfg, seqlen_q, seqlen_k, num_tokens, drafts, state_id, blocks) -> SequenceMetadata:
    """``blocks``: this batch's free block ids (a shuffled list, consumed: tables are disjoint)."""
    q_start = seqlen_k - seqlen_q
    need = cfg.num_blocks_for(seqlen_k)
    table = [blocks.pop() for _ in range(need + int(rng.integers(0, 3)))]
    n_images = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0
    return SequenceMetadata(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        block_table=np.asarray(table, dtype=np.int64),
        state_id=state_id,
        token_ids=rng.integers(0, VOCAB, num_tokens),
        is_placeholder=bool(rng.random() < 0.15),
        swa_valid_start=int(rng.integers(0, q_start + 1)) if rng.random() < 0.4 else 0,
        draft_tokens=tuple(int(x) for x in rng.integers(0, VOCAB, drafts)),
        compressed_token_ids=rng.integers(100, 200, int(rng.integers(0, seqlen_k + 2))),
        lookup_table=np.arange(VOCAB) + 1000,
        image_positions=tuple(int(x) for x in rng.integers(0, seqlen_k, n_images)),
    )


def random_prompt_batch(rng, cfg, n: int | None = None) -> list[SequenceMetadata]:
    n = int(rng.integers(1, 6)) if n is None else n
    states, blocks = rng.permutation(64), list(rng.permutation(np.arange(1, 4096)))
    seqs = []
    for i in range(n):
        seqlen_k = int(rng.integers(1, cfg.max_model_len + 1))
        seqlen_q = int(rng.integers(1, seqlen_k + 1))
        extra = int(rng.integers(0, 3))
        seqs.append(_seq(rng, cfg, seqlen_q, seqlen_k, seqlen_k + extra, 0, int(states[i]), blocks))
    return seqs


def random_decode_batch(rng, cfg, n: int | None = None) -> list[SequenceMetadata]:
    n = int(rng.integers(1, 6)) if n is None else n
    states, blocks = rng.permutation(64), list(rng.permutation(np.arange(1, 4096)))
    max_drafts = min(cfg.swa_block_size - cfg.window_size, 3)
    seqs = []
    for i in range(n):
        drafts = int(rng.integers(0, max_drafts + 1))
        seqlen_k = int(rng.integers(1 + drafts, cfg.max_model_len + 1))
        num_tokens = seqlen_k - drafts
        seqs.append(
            _seq(rng, cfg, 1 + drafts, seqlen_k, num_tokens, drafts, int(states[i]), blocks)
        )
    return seqs


def assert_fields_equal(meta, ref: dict, *, block_table_prefix: list[int] | None = None) -> None:
    """Every field of the reference dict equals the metadata's (tensors compared exactly)."""
    for name, want in ref.items():
        got = getattr(meta, name)
        if isinstance(want, dict):
            assert isinstance(got, dict) and sorted(got) == sorted(want), (name, got, want)
            for key in want:
                _same(f"{name}[{key!r}]", got[key], want[key])
        elif name == "block_tables" and block_table_prefix is not None:
            got = got.cpu().numpy()
            for row, nb in enumerate(block_table_prefix):
                np.testing.assert_array_equal(got[row, :nb], want[row, :nb], err_msg=name)
        else:
            _same(name, got, want)


def _same(name, got, want) -> None:
    if want is None or isinstance(want, int):
        assert got == want, (name, got, want)
        return
    assert isinstance(got, torch.Tensor), (name, type(got))
    expect_dtype = torch.bool if want.dtype == bool else torch.int32
    assert got.dtype == expect_dtype, (name, got.dtype)
    np.testing.assert_array_equal(got.cpu().numpy().reshape(want.shape), want, err_msg=name)
    assert tuple(got.shape) == want.shape, (name, tuple(got.shape), want.shape)
