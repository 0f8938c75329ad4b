"""Prompt-lookup drafts and verification (pure functions, exact)."""

from __future__ import annotations

import random

import pytest

from kvplan.engine.speculative import NgramProposer, accept_drafts


def _propose_ref(tokens, k, max_n, min_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tail]
        for s in reversed(starts):
            follow = tokens[s + n : s + n + k]
            if follow:
                return follow
    return []


def test_examples():
    p = NgramProposer(num_draft_tokens=2, max_ngram=3)
    assert p.propose([5, 6, 7, 8, 9, 1, 5, 6, 7]) == [8, 9]
    assert p.propose([1, 2, 3]) == []
    assert p.propose([4, 4, 4]) == [4]  # the match may overlap the tail
    assert accept_drafts([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accept_drafts([4, 5], [4, 5, 3]) == [4, 5, 3]
    assert accept_drafts([7], [4, 5]) == [4]
    with pytest.raises(ValueError):
        accept_drafts([1], [1])


@pytest.mark.parametrize("seed", range(20))
def test_propose_matches_reference(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
    p = NgramProposer(num_draft_tokens=3, max_ngram=3, min_ngram=1)
    assert p.propose(tokens) == _propose_ref(tokens, 3, 3, 1)


def test_accepted_tokens_are_the_greedy_tokens():
    rng = random.Random(0)
    for _ in range(100):
        greedy = [rng.randrange(3) for _ in range(5)]
        drafts = [rng.randrange(3) for _ in range(4)]
        new = accept_drafts(drafts, greedy)
        assert new == greedy[: len(new)]
        assert drafts[: len(new) - 1] == greedy[: len(new) - 1]
